"""crabctl and crabd as `make setup` installs them: on PATH, usable by every member of group crab.

Issue 35: the only crabctl was the checkout venv's, whose interpreter lives under root's 0700 home,
so a member of group crab got "Permission denied"; and a user outside the group was told to start
crabd while it ran.  These run the installed commands as throwaway users (tests/integration/conftest.py
``users``: one in group crab, one not; removed afterwards) against a private crabd whose socket is
0660 root:crab, as crabd.service's is.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.sdk import EmbeddedDaemon
from tests.conftest import REPO, have_docker, have_root, require
from tests.integration.conftest import USER_IN_GROUP, USER_OUTSIDE

pytestmark = pytest.mark.root

VENV = Path("/opt/crab/venv")
BIN_DIR = Path("/usr/local/bin")
#: A login's PATH, without the checkout's venv: what a user of the host has.
USER_PATH = "/usr/local/bin:/usr/bin:/bin"


@pytest.fixture(scope="module")
def installed() -> None:
    """The install `make setup` makes (scripts/install-crab.sh), current with this checkout.

    The script rebuilds only when the package's files changed, so after `make setup` this is a check
    (well under a second); it is run here so that the commands tested are this checkout's.
    """
    require(have_root(), "needs root")
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-crab.sh")],
        env={**os.environ, "BUILD_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def crabd(installed: None) -> Iterator[EmbeddedDaemon]:
    """A private crabd (no sandbox is made); its socket is 0660 root:crab in a directory others may enter."""
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    d = EmbeddedDaemon()
    d.start()
    os.chmod(d.base, 0o711)  # mkdtemp's 0700 would refuse everyone before the socket's own mode is reached
    try:
        yield d
    finally:
        d.close()


def as_user(name: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` run as ``name`` (with that user's groups, as a login has them), from /, on a user's PATH."""
    return subprocess.run(
        ["runuser", "-u", name, "--", "env", "-i", f"PATH={USER_PATH}", "HOME=/", "LANG=C.UTF-8", *argv],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_commands_are_on_path_from_a_venv_anyone_can_read(installed: None) -> None:
    for cmd in ("crabctl", "crabd"):
        link = BIN_DIR / cmd
        assert link.resolve() == (VENV / "bin" / cmd).resolve(), f"{link} is not the /opt/crab install"
    python = (VENV / "bin" / "python").resolve()
    assert not python.is_relative_to("/root") and not python.is_relative_to("/home"), python
    # Every directory from / to the interpreter and the package may be entered by others.
    site = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", "import crabd, os; print(os.path.dirname(crabd.__file__))"],
        cwd="/",
        env={"PATH": USER_PATH},  # no PYTHONPATH: the install's own package, not the checkout's
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert site.startswith(str(VENV)), f"the install's crabd is {site}, not a copy in {VENV}"
    for target in (python, Path(site) / "__init__.py"):
        for p in [target, *target.parents]:
            mode = p.stat().st_mode
            assert mode & (stat.S_IXOTH if p.is_dir() else stat.S_IROTH), f"{p} is {stat.filemode(mode)}"


def test_a_member_of_group_crab_runs_crabctl(crabd: EmbeddedDaemon, users: dict[str, tuple[int, int]]) -> None:
    assert stat.S_IMODE(crabd.socket.stat().st_mode) == 0o660
    where = as_user(USER_IN_GROUP, "sh", "-c", "command -v crabctl")
    assert where.stdout.strip() == str(BIN_DIR / "crabctl"), where
    helped = as_user(USER_IN_GROUP, "crabctl", "--help")
    assert helped.returncode == 0 and "Usage" in helped.stdout, helped.stderr
    version = as_user(USER_IN_GROUP, "crabctl", "--version")
    assert version.returncode == 0 and version.stdout.strip(), version.stderr
    listed = as_user(USER_IN_GROUP, "crabctl", "--socket", str(crabd.socket), "ps", "--json")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip() == "[]"  # the member sees none of root's sandboxes (there are none)
    daemon_help = as_user(USER_IN_GROUP, "crabd", "--help")
    assert daemon_help.returncode == 0 and "--socket" in daemon_help.stdout, daemon_help.stderr


def test_a_user_outside_the_group_is_told_about_membership(
    crabd: EmbeddedDaemon, users: dict[str, tuple[int, int]]
) -> None:
    refused = as_user(USER_OUTSIDE, "crabctl", "--socket", str(crabd.socket), "ps")
    assert refused.returncode != 0
    text = " ".join((refused.stdout + refused.stderr).split())  # as one line: rich wraps at 80 columns
    assert f"cannot reach crabd at {crabd.socket}: permission denied" in text, text
    assert f"usermod -aG crab {USER_OUTSIDE}" in text and "log out and in again" in text, text
    assert "systemctl start" not in text, text  # crabd runs: starting it is not the fix


def test_a_missing_socket_says_crabd_is_not_running(installed: None, users: dict[str, tuple[int, int]]) -> None:
    gone = as_user(USER_IN_GROUP, "crabctl", "--socket", "/run/crab-no-such-dir/crabd.sock", "ps")
    assert gone.returncode != 0
    text = " ".join((gone.stdout + gone.stderr).split())
    assert "no socket there (crabd is not running)" in text and "systemctl start crabd" in text, text


def test_a_second_install_rebuilds_nothing(installed: None) -> None:
    python = VENV / "bin" / "python"
    before = (python.lstat().st_mtime_ns, (VENV / ".crab-fingerprint").stat().st_mtime_ns)
    start = time.monotonic()
    again = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-crab.sh")],
        env={**os.environ, "BUILD_PYTHON": "/nonexistent"},  # a rebuild would fail: there is nothing to build with
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - start
    assert again.returncode == 0, again.stderr
    assert "is current" in again.stderr and "building" not in again.stderr
    assert took < 5, f"a second install took {took:.1f} s"
    assert (python.lstat().st_mtime_ns, (VENV / ".crab-fingerprint").stat().st_mtime_ns) == before
