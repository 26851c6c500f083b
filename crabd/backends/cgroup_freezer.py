"""Freezing a container's processes with the cgroup freezer, for consistent cuts.

cgroup v1 (this host's hybrid layout): ``freezer/docker/<id>/freezer.state``
(Docker) or ``freezer/crab/<id>/freezer.state`` (crab's runc layer; where a
container's cgroup is: :mod:`crabd.util.cgroups`) takes ``FROZEN``/``THAWED``.
The kernel reports ``FREEZING`` until every task has stopped, so we poll
(with a short back-off starting at 50 µs) until it reads ``FROZEN``; a
small container freezes in about 0.2 ms.
CRIU's own freezer step polls at a far coarser interval, which is one
reason crab freezes the container itself before dumping.

cgroup v2: ``cgroup.freeze`` takes 1/0 and ``cgroup.events`` reports
``frozen 1``.  Docker puts a container under ``docker/<id>`` (cgroupfs
driver) or ``system.slice/docker-<id>.scope`` (systemd driver), crab's runc
layer under ``crab/<id>``.

runc reads the freezer's state live: while frozen here, ``runc state``
says ``paused``, and a thaw here makes it ``running`` again (so a freeze
that a killed crabd left behind is undone the same way for both engines).

Freezing also freezes descendants (nested cgroups), and a task stuck in
uninterruptible sleep can hold the freeze off: after
:data:`FREEZE_TIMEOUT_S` the container is thawed again and the caller
gets an error, so a sandbox is never left frozen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from crabd.errors import HostError
from crabd.util import cgroups

CGROUP_ROOT = cgroups.CGROUP_ROOT
FREEZE_TIMEOUT_S = 5.0


def _v1_state(container_id: str) -> Path | None:
    base = cgroups.v1_dir(container_id, "freezer", CGROUP_ROOT)
    return base / "freezer.state" if base is not None else None


def _v2_dir(container_id: str) -> Path | None:
    base = cgroups.v2_dir(container_id, CGROUP_ROOT)
    return base if base is not None and (base / "cgroup.freeze").exists() else None


def _short(container_id: str) -> str:
    """Docker's 64-hex ids shortened as Docker shows them; crab's runc ids whole (their head is the instance)."""
    return container_id[:12] if cgroups.is_docker_id(container_id) else container_id


def _wait(done: Callable[[], bool], container_id: str) -> None:
    deadline = time.monotonic() + FREEZE_TIMEOUT_S
    delay = 0.00005
    while not done():
        if time.monotonic() > deadline:
            raise HostError(
                f"container {_short(container_id)} did not freeze within {FREEZE_TIMEOUT_S:g} s "
                "(a process may be stuck in uninterruptible I/O)",
                hint="Retry the checkpoint; if it keeps failing, look for processes in D state in the sandbox.",
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.005)


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise HostError(f"cannot write {value!r} to {path}: {exc.strerror}") from exc


def freeze(container_id: str) -> None:
    state = _v1_state(container_id)
    if state is not None:
        _write(state, "FROZEN")
        _wait(lambda: state.read_text().strip() == "FROZEN", container_id)
        return
    base = _v2_dir(container_id)
    if base is None:
        raise HostError(
            f"no cgroup freezer found for container {_short(container_id)}",
            hint="crab needs the cgroup v1 freezer or cgroup v2; see `crabctl doctor`.",
        )
    _write(base / "cgroup.freeze", "1")
    _wait(lambda: "frozen 1" in (base / "cgroup.events").read_text(), container_id)


def thaw(container_id: str) -> None:
    state = _v1_state(container_id)
    if state is not None:
        _write(state, "THAWED")
        return
    base = _v2_dir(container_id)
    if base is not None:
        _write(base / "cgroup.freeze", "0")


@contextmanager
def frozen(container_id: str) -> Iterator[None]:
    """Freeze for the ``with`` body; thaw on every way out, a failed freeze included."""
    try:
        freeze(container_id)
        yield
    finally:
        thaw(container_id)
