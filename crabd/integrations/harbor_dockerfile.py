"""A Harbor task's Dockerfile as steps crab can replay in a sandbox (for :mod:`crabd.integrations.harbor`).

crabd starts sandboxes only from its own env images, so a task's Dockerfile
must say ``FROM crab-env/<env>``; its ``RUN``, ``WORKDIR``, ``ENV``, ``ARG``,
``USER`` and local ``COPY``/``ADD`` become steps replayed in the new
sandbox; what only matters when Docker runs the container (``CMD``,
``ENTRYPOINT``, ...) is ignored; anything else is refused before a sandbox
is made.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

#: The image prefix crab's env images carry (crabd/host/images.py: ``crab-env/<name>:<content tag>``).
CRAB_IMAGE_PREFIX = "crab-env/"
#: Dockerfile instructions that mean nothing for a crab sandbox (Harbor runs its own commands).
IGNORED_INSTRUCTIONS = frozenset({"CMD", "ENTRYPOINT", "LABEL", "EXPOSE", "VOLUME", "STOPSIGNAL", "HEALTHCHECK"})
_VAR_RE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True)
class RunStep:
    """A ``RUN``: shell text, run in ``workdir`` with ``env`` as ``user`` (``""``: the sandbox's)."""

    command: str
    workdir: str
    env: Mapping[str, str]
    user: str = ""


@dataclass(frozen=True)
class CopyStep:
    """A ``COPY``/``ADD`` of local files (relative to the task's environment dir) to ``dest``.

    ``chown``/``chmod``: the instruction's ``--chown``/``--chmod`` (files are root's otherwise, as in Docker).
    """

    sources: tuple[str, ...]
    dest: str
    chown: str = ""
    chmod: str = ""


@dataclass
class EnvPlan:
    """What a task's environment is in crab's terms: a crab env and the steps that make the rest, or an image.

    ``image``: any image the host's Docker has (the task's ``docker_image``);
    ``build``: a directory whose Dockerfile crab cannot replay, for Docker to
    build into that image at start.  ``env`` is "" then.
    """

    env: str
    steps: list[RunStep | CopyStep] = field(default_factory=list)
    image: str = ""
    build: str = ""
    workdir: str = ""
    env_vars: dict[str, str] = field(default_factory=dict)
    user: str = ""


def crab_env_of(image: str) -> str:
    """The crab env that ``image`` names (``crab-env/<env>[:<tag>]``), or a ValueError saying why not."""
    ref = image.strip()
    if ref.startswith("docker.io/"):
        ref = ref.removeprefix("docker.io/")
    if not ref.startswith(CRAB_IMAGE_PREFIX):
        raise ValueError(
            f"FROM {image}: crab starts sandboxes only from its own env images (crab-env/<env>, built "
            "from envs/images by `crabctl env build`), not from other images; write e.g. "
            "`FROM crab-env/bookworm` and install what the task needs with RUN"
        )
    name = ref.removeprefix(CRAB_IMAGE_PREFIX).split("@", 1)[0].split(":", 1)[0]
    if not name or "/" in name:
        raise ValueError(f"FROM {image}: not a crab env image (crab-env/<env>[:<tag>])")
    return name


def _logical_lines(text: str) -> list[str]:
    """The Dockerfile's instructions: comments dropped, backslash continuations joined."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        pending += stripped
        if pending.strip():
            out.append(pending.strip())
        pending = ""
    if pending.strip():
        out.append(pending.strip())
    return out


def _expand(text: str, variables: Mapping[str, str]) -> str:
    return _VAR_RE.sub(lambda m: variables.get(m.group(1) or m.group(2), ""), text)


def _words(args: str) -> list[str]:
    """An instruction's arguments: the JSON (exec) form or shell-like words."""
    if args.startswith("["):
        try:
            value = json.loads(args)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cannot parse {args!r} as a JSON array") from exc
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{args!r} is not a JSON array of strings")
        return list(value)
    return shlex.split(args)


def _key_values(args: str) -> list[tuple[str, str]]:
    """``ENV``/``ARG`` arguments: ``K=V ...``, or the legacy ``K V`` form (``ARG K`` has no value)."""
    words = shlex.split(args)
    if len(words) >= 1 and "=" not in words[0]:
        return [(words[0], " ".join(words[1:]))]
    pairs = []
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise ValueError(f"{word!r}: expected KEY=VALUE")
        pairs.append((key, value))
    return pairs


def plan_dockerfile(text: str) -> EnvPlan:
    """Map a Dockerfile onto a crab env and replayable steps; a ValueError says what crab cannot do."""
    plan: EnvPlan | None = None
    args: dict[str, str] = {}
    for line in _logical_lines(text):
        instruction, _, rest = line.partition(" ")
        op, rest = instruction.upper(), rest.strip()
        if "<<" in rest and op in ("RUN", "COPY", "ADD"):
            raise ValueError(f"{op} with a heredoc is not supported: {line[:80]}")
        if op == "ARG":
            for key, value in _key_values(rest):
                args[key] = _expand(value, args)
            continue
        if op == "FROM":
            if plan is not None:
                raise ValueError("multi-stage Dockerfiles (a second FROM) are not supported")
            words = [w for w in rest.split() if not w.startswith("--")]
            if len(words) not in (1, 3):
                raise ValueError(f"cannot parse {line!r}")
            plan = EnvPlan(env=crab_env_of(_expand(words[0], args)))
            continue
        if plan is None:
            raise ValueError(f"{op} before FROM")
        variables = {**args, **plan.env_vars}
        if op in IGNORED_INSTRUCTIONS:
            continue
        if op == "RUN":
            if rest.startswith("--"):
                raise ValueError(f"RUN options are not supported: {line[:80]}")
            command = shlex.join(_words(rest)) if rest.startswith("[") else rest
            plan.steps.append(RunStep(command, plan.workdir or "/", variables, plan.user))
        elif op in ("COPY", "ADD"):
            words = _words(rest)
            flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
            bad = sorted(set(flags) - {"chown", "chmod"})
            if bad:
                raise ValueError(f"{op} --{' --'.join(bad)} is not supported (only local files are copied)")
            paths = [_expand(w, variables) for w in words if not w.startswith("--")]
            if len(paths) < 2:
                raise ValueError(f"cannot parse {line!r}")
            if any("://" in p for p in paths[:-1]):
                raise ValueError(f"{op} from a URL is not supported: {line[:80]}")
            dest = paths[-1]
            if not dest.startswith("/"):
                base = plan.workdir or "/"
                dest = str(PurePosixPath(base) / dest) + ("/" if dest.endswith("/") else "")
            plan.steps.append(CopyStep(tuple(paths[:-1]), dest, flags.get("chown", ""), flags.get("chmod", "")))
        elif op == "WORKDIR":
            target = _expand(rest, variables)
            plan.workdir = str(PurePosixPath(plan.workdir or "/") / target)
            plan.steps.append(RunStep(f"mkdir -p {shlex.quote(plan.workdir)}", "/", {}))
        elif op == "ENV":
            for key, value in _key_values(rest):
                plan.env_vars[key] = _expand(value, variables)
                variables[key] = plan.env_vars[key]
        elif op == "USER":
            plan.user = _expand(rest, variables).split(":", 1)[0]
        else:
            raise ValueError(f"the Dockerfile instruction {op} is not supported by crab's harbor environment")
    if plan is None:
        raise ValueError("the Dockerfile has no FROM")
    return plan
