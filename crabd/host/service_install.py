"""``crabctl host install-service``: crabd as a systemd service, from the installed package's files.

What it installs (the sources are the package's copies of ``systemd/``, see
:mod:`crabd.util.resources`):

=====================================  ==========================  ===================
target                                 from                        when it exists
=====================================  ==========================  ===================
``/etc/systemd/system/crabd.service``  ``systemd/crabd.service``   replaced if it differs
``/usr/lib/sysusers.d/crab.conf``      ``systemd/crab.sysusers``   replaced if it differs
``/usr/lib/tmpfiles.d/crab.conf``      ``systemd/crab.tmpfiles``   replaced if it differs
``/etc/crab/crabd.toml``               a commented default         never touched
=====================================  ==========================  ===================

The unit's ``ExecStart=`` names ``/opt/crab/venv/bin/crabd`` in the
repository; the installed unit names the ``crabd`` of the environment this
command runs from (``--prefix`` picks another: ``<prefix>/bin/crabd``), so the
service runs the very package that installed it.  :func:`rewrite_exec_start`
keeps the line's arguments and adds a comment saying so.

Then, on the running system only (not with ``--root``): the ``crab`` group
(``systemd-sysusers`` on the installed file where present, else ``groupadd
--system``), and, only where systemd is PID 1 (``/run/systemd/system``
exists, as sd_booted(3) checks) and ``--no-start`` is not given,
``systemd-tmpfiles --create``, ``systemctl daemon-reload`` and ``systemctl
enable --now crabd``.  Elsewhere the files are installed and the report says
why nothing was started.  Every run is idempotent: files equal to what it
would write are left alone, and a dry run lists what it would write or replace.
"""

from __future__ import annotations

import enum
import grp
import os
import re
import shutil
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crabd.errors import HostError
from crabd.util import proc, resources

UNIT = Path("/etc/systemd/system/crabd.service")
SYSUSERS = Path("/usr/lib/sysusers.d/crab.conf")
TMPFILES = Path("/usr/lib/tmpfiles.d/crab.conf")
CONFIG = Path("/etc/crab/crabd.toml")
GROUP = "crab"
SERVICE = "crabd"
#: sd_booted(3): systemd runs as PID 1 exactly when this directory exists.
SYSTEMD_RUNDIR = Path("/run/systemd/system")
COMMAND_TIMEOUT_S = 120.0

DEFAULT_CONFIG = """\
# crabd's configuration.  Written by `crabctl host install-service` because none
# was here; it never replaces this file.  Every setting has a default: see
# docs/config.md in crab's repository, or `crabctl doctor` for what this host lacks.
#
# [paths]
# state_dir = "/var/lib/crab"
# socket = "/run/crab/crabd.sock"
# log_dir = "/var/log/crab"
"""

_EXEC_START = re.compile(r"^ExecStart=(?P<flags>[-@:+!]*)(?P<path>\S+)(?P<args>.*)$")


class Action(enum.StrEnum):
    CREATE = "create"
    REPLACE = "replace"
    KEEP = "keep"


@dataclass(frozen=True)
class FilePlan:
    """One file: where it goes on the target system, what it holds, and what installing it does."""

    target: Path
    path: Path  # the target under --root
    content: bytes
    action: Action

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.target), "written_to": str(self.path), "action": self.action.value}


@dataclass
class Report:
    files: list[FilePlan]
    #: Commands run (or, in a dry run, to run), as shell-like text.
    commands: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"files": [f.as_dict() for f in self.files], "commands": self.commands, "notes": self.notes}


def crabd_executable(prefix: Path | None = None) -> Path:
    """The ``crabd`` the unit will run: ``<prefix>/bin/crabd``, else the one beside this environment's scripts."""
    where = (prefix / "bin") if prefix is not None else Path(sysconfig.get_path("scripts"))
    crabd = Path(os.path.abspath(where / "crabd"))
    if not (crabd.is_file() and os.access(crabd, os.X_OK)):
        raise HostError(
            f"no crabd executable at {crabd}",
            hint="Install crab into that environment (pip install crabd-*.whl) or give --prefix ENV.",
        )
    return crabd


def _unit_word(path: Path) -> str:
    text = str(path)
    if any(c in text for c in '"\\\n'):
        raise HostError(f"cannot name {text!r} in a unit's ExecStart=", hint="Install crab under a plainer path.")
    text = text.replace("%", "%%")  # systemd specifiers
    return f'"{text}"' if any(c.isspace() for c in text) else text


def rewrite_exec_start(unit: str, crabd: Path) -> str:
    """``unit`` with its one ``ExecStart=`` running ``crabd`` (flags and arguments kept)."""
    lines = unit.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.startswith("ExecStart=")]
    if len(hits) != 1:
        raise HostError(f"the packaged crabd.service has {len(hits)} ExecStart= lines; expected one")
    i = hits[0]
    m = _EXEC_START.match(lines[i].rstrip("\n"))
    if m is None:
        raise HostError(f"cannot parse the packaged unit's line {lines[i].strip()!r}")
    note = "# ExecStart: the crabd of the environment `crabctl host install-service` ran from.\n"
    lines[i] = f"{note}ExecStart={m['flags']}{_unit_word(crabd)}{m['args']}\n"
    return "".join(lines)


def under(root: Path, target: Path) -> Path:
    return root / target.relative_to("/")


def plan_files(root: Path, crabd: Path) -> list[FilePlan]:
    """Each file to install and whether it would be created, replaced or kept."""
    wanted: list[tuple[Path, bytes, bool]] = [
        (UNIT, rewrite_exec_start(resources.systemd_file("crabd.service").read_text(), crabd).encode(), True),
        (SYSUSERS, resources.systemd_file("crab.sysusers").read_bytes(), True),
        (TMPFILES, resources.systemd_file("crab.tmpfiles").read_bytes(), True),
        (CONFIG, DEFAULT_CONFIG.encode(), False),
    ]
    plans = []
    for target, content, replace in wanted:
        path = under(root, target)
        if not path.exists():
            action = Action.CREATE
        elif not replace or path.read_bytes() == content:
            action = Action.KEEP
        else:
            action = Action.REPLACE
        plans.append(FilePlan(target, path, content, action))
    return plans


def write_file(path: Path, content: bytes, mode: int = 0o644) -> None:
    """Write ``path`` atomically (a temporary name beside it, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    tmp = path.with_name(f".{path.name}.crab-{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def group_exists(name: str = GROUP) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def group_argv(which: Callable[[str], str | None] | None = None) -> list[str]:
    """How to make the crab group: from the installed sysusers file where systemd-sysusers exists."""
    if (which or shutil.which)("systemd-sysusers"):
        return ["systemd-sysusers", str(SYSUSERS)]
    return ["groupadd", "--system", GROUP]


def systemd_is_pid1(rundir: Path = SYSTEMD_RUNDIR) -> bool:
    return rundir.is_dir()


def pid1_name() -> str:
    try:
        return Path("/proc/1/comm").read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def service_argvs() -> list[list[str]]:
    return [
        ["systemd-tmpfiles", "--create", str(TMPFILES)],
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "--now", SERVICE],
    ]


def _run(argv: list[str]) -> None:
    proc.run(argv, timeout=COMMAND_TIMEOUT_S)


def install(
    *,
    root: Path = Path("/"),
    prefix: Path | None = None,
    dry_run: bool = False,
    start: bool = True,
    run: Callable[[list[str]], None] | None = None,
    systemd: bool | None = None,
) -> Report:
    """Install (or, with ``dry_run``, plan) the service; see the module doc.  ``run``/``systemd``: for tests."""
    root = Path(os.path.abspath(root))
    live = root == Path("/")
    if not dry_run and live and os.geteuid() != 0:
        raise HostError(
            "crabctl host install-service must run as root (it writes /etc and /usr/lib)",
            hint="Run it with sudo, or give --root DIR to install under another root.",
        )
    runner = run or _run
    report = Report(plan_files(root, crabd_executable(prefix)))
    if not dry_run:
        for f in report.files:
            if f.action is not Action.KEEP:
                write_file(f.path, f.content)
    if not live:
        report.notes.append(
            f"installed under {root}: the crab group and the service are left to that system "
            "(systemd-sysusers reads the sysusers file at its boot)"
        )
        return report
    argvs: list[list[str]] = []
    if not group_exists():
        argvs.append(group_argv())
    if not start:
        report.notes.append("--no-start: crabd is not enabled or started")
    elif not (systemd_is_pid1() if systemd is None else systemd):
        report.notes.append(
            f"systemd is not running here (PID 1 is {pid1_name()}): crabd is "
            + ("not to be" if dry_run else "neither")
            + " enabled or started; run it yourself (crabd --config /etc/crab/crabd.toml), or on a "
            "systemd host: systemctl enable --now crabd"
        )
    else:
        argvs += service_argvs()
        if any(f.target == UNIT and f.action is Action.REPLACE for f in report.files):
            report.notes.append("the unit changed: `systemctl restart crabd` runs the new one (sandboxes keep running)")
    for argv in argvs:
        report.commands.append(" ".join(argv))
        if not dry_run:
            runner(argv)
    return report
