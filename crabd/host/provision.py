"""``crabctl host setup``: the repository's ``make setup`` for a host that has only the installed package.

The same idempotent steps, in the same order, each checking first:

1. ``host``: the host set-up script (``scripts/setup-host.sh``, the very file
   ``make host`` runs, or its copy in the installed package): apt packages,
   CRIU, kernel headers, tracefs, Docker, the ``crab`` group, the btrfs pool;
2. ``crab-init``: the sandboxes' init, compiled where
   :func:`crabd.util.resources.crab_init_binary` says;
3. ``images``: the env images whose recipe changed (``crabctl env build``);
4. ``criu-kdat``: CRIU's kernel-feature cache (``python -m crabd.host.criu_kdat install``).

(``make setup``'s virtualenv steps have no counterpart: the package is installed already.)

With ``dry_run`` nothing is changed: the script runs with ``CRAB_DRY_RUN=1``
and reports each change as a ``[setup-host] would ...`` line, and the other
steps only check; every :class:`Step` then lists what it would change.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from crabd.errors import CommandError, CrabError, HostError
from crabd.host import criu_kdat, images
from crabd.runtime import initbin
from crabd.util import proc, resources

#: The whole host script on a fresh machine takes about 20 s (apt, CRIU, headers); far more means a hang.
SCRIPT_TIMEOUT_S = 1800.0
DRY_RUN_TIMEOUT_S = 120.0
_WOULD = re.compile(r"^\[setup-host\] would (.+)$")

Echo = Callable[[str], None]


@dataclass(frozen=True)
class Step:
    """One set-up step: what it changed (or, in a dry run, would change); empty when nothing."""

    name: str
    changes: tuple[str, ...] = ()
    detail: str = ""
    #: Lines the step printed (the script's log), for a dry run's report.
    log: tuple[str, ...] = field(default=(), repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.name, "changes": list(self.changes), "detail": self.detail}


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise HostError(
            f"{what} must run as root (it installs packages, files and services on this host)",
            hint=f"Run it with sudo: sudo {what}",
        )


def would_lines(log: str) -> list[str]:
    """The changes a dry run of the host script reported (its ``[setup-host] would ...`` lines)."""
    return [m.group(1) for line in log.splitlines() if (m := _WOULD.match(line.strip()))]


def script_env(dry_run: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.pop("CRAB_DRY_RUN", None)
    if dry_run:
        env["CRAB_DRY_RUN"] = "1"
    return env


def host_step(dry_run: bool) -> Step:
    script = resources.setup_script()
    argv = ["bash", str(script)]
    if dry_run:
        done = proc.run(argv, timeout=DRY_RUN_TIMEOUT_S, env=script_env(True))
        log = done.err + done.out
        return Step("host", tuple(would_lines(log)), str(script), tuple(log.splitlines()))
    proc.run(argv, timeout=SCRIPT_TIMEOUT_S, env=script_env(False), stream=True)
    return Step("host", (), f"{script}: host ready")


def crab_init_step(dry_run: bool) -> Step:
    target = initbin.binary_path()
    if initbin.is_built():
        return Step("crab-init", (), f"{target} is up to date")
    if dry_run:
        return Step("crab-init", (f"compile crab-init into {target}",), str(initbin.source_path()))
    built = initbin.build()
    return Step("crab-init", (f"compiled {built}",), str(initbin.source_path()))


def docker_answers() -> bool:
    try:
        return proc.run(["docker", "info"], timeout=20, check=False).exit_code == 0
    except CommandError:  # no docker CLI at all
        return False


def plan_images(recipes: Sequence[images.Recipe], exists: Callable[[str], bool], engine_up: bool) -> tuple[str, ...]:
    """The images a build would make: those whose content-tagged ref the engine lacks."""
    if not engine_up:
        return tuple(f"build {r.image_ref} (the Docker engine does not answer yet: it may have it)" for r in recipes)
    return tuple(f"build {r.image_ref}" for r in recipes if not exists(r.image_ref))


def images_step(dry_run: bool, echo: Echo) -> Step:
    recipes = images.list_recipes()
    where = str(resources.env_recipes_dir())
    if dry_run:
        return Step("images", plan_images(recipes, images.image_exists, docker_answers()), where)
    changes = []
    for recipe in recipes:
        echo(f"[setup] image {recipe.name}: checking {recipe.image_ref}")
        ref, built = images.build(recipe)
        if built:
            images.remove_stale(recipe)
            changes.append(f"built {ref}")
        echo(f"[setup] image {recipe.name}: {'built' if built else 'up to date'} {ref}")
    return Step("images", tuple(changes), where)


def kdat_step(dry_run: bool) -> Step:
    state = criu_kdat.status()
    if dry_run:
        if state.state is criu_kdat.KdatState.ABSENT:
            return Step("criu-kdat", (f"write {criu_kdat.KDAT}",), state.detail)
        return Step("criu-kdat", (), state.detail)
    if state.state is criu_kdat.KdatState.CRIU_KEEPS:
        return Step("criu-kdat", (), state.detail)
    criu = shutil.which("criu")
    if criu is None:
        return Step("criu-kdat", (), "warning: criu is not on PATH; no kernel-feature cache (crabd makes it at start)")
    try:
        done = criu_kdat.ensure(criu)
    except (CrabError, OSError) as exc:
        # Speed only, as in `make setup`: set-up goes on, and `crabctl doctor` warns.
        return Step("criu-kdat", (), f"warning: no CRIU kernel-feature cache: {exc}")
    return Step("criu-kdat", (f"wrote {criu_kdat.KDAT}",), done.detail)


def setup(*, dry_run: bool, skip_images: bool, echo: Echo) -> list[Step]:
    """Run (or, with ``dry_run``, plan) every step; ``echo`` reports progress on stderr."""
    require_root("crabctl host setup")
    steps = [host_step(dry_run)]  # the script logs its own progress

    def add(step: Step) -> None:
        if not dry_run:  # a dry run's plan is reported whole at the end
            echo(f"[setup] {step.name}: {'; '.join(step.changes) or step.detail}")
        steps.append(step)

    add(crab_init_step(dry_run))
    add(Step("images", (), "skipped (--skip-images)") if skip_images else images_step(dry_run, echo))
    add(kdat_step(dry_run))
    return steps
