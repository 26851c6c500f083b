"""runc's state files read without runc (crabd/backends/runc/statefile.py): status in runc's order, fallbacks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from crabd.backends.runc import statefile
from crabd.backends.runc.cli import Runc, RuncState, RuncStatus
from crabd.backends.runc.statefile import StateFiles, Unreadable


def _me() -> tuple[int, int]:
    start, _ = statefile.proc_start(os.getpid()) or (0, "")
    return os.getpid(), start


def write_state(root: Path, cid: str, *, pid: int, start: int, cgroups: dict[str, str] | None = None) -> Path:
    d = root / cid
    d.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "id": cid,
        "init_process_pid": pid,
        "init_process_start": start,
        "created": "2026-11-26T19:17:00.123456789Z",
        "config": {"rootfs": "/b/rootfs", "labels": ["bundle=/b", "crab.sandbox=sb1", "note=a=b"]},
        "cgroup_paths": cgroups or {},
    }
    (d / "state.json").write_text(json.dumps(data))
    return d


def test_a_live_init_is_running_and_the_record_is_runcs(tmp_path: Path) -> None:
    pid, start = _me()
    write_state(tmp_path, "c1", pid=pid, start=start)
    files = StateFiles(tmp_path)
    rec = files.record("c1")
    assert rec is not None and files.status("c1", rec) == "running"
    assert (rec.bundle, rec.rootfs) == ("/b", "/b/rootfs")
    assert rec.annotations == {"crab.sandbox": "sb1", "note": "a=b"}  # split at the first "=", as runc does
    got = Runc(tmp_path).state("c1")
    assert got == RuncState(
        id="c1",
        pid=pid,
        status=RuncStatus.RUNNING,
        bundle=Path("/b"),
        rootfs="/b/rootfs",
        created="2026-11-26T19:17:00.123456789Z",
        annotations={"crab.sandbox": "sb1", "note": "a=b"},
    )


def test_status_in_runcs_order(tmp_path: Path) -> None:
    pid, start = _me()
    freezer = tmp_path / "cg"
    freezer.mkdir()
    d = write_state(tmp_path, "c1", pid=pid, start=start, cgroups={"freezer": str(freezer), "memory": "/x"})
    files = StateFiles(tmp_path)
    rec = files.record("c1")
    assert rec is not None
    (d / "exec.fifo").touch()
    assert files.status("c1", rec) == "created"
    (freezer / "freezer.state").write_text("FROZEN\n")
    assert files.status("c1", rec) == "paused"  # asked first, as runc does
    (freezer / "freezer.state").write_text("THAWED\n")
    (d / "exec.fifo").unlink()
    assert files.status("c1", rec) == "running"
    # The same pid with another start time is another process: the init is gone.
    other = write_state(tmp_path, "c2", pid=pid, start=start + 1)
    rec2 = files.record("c2")
    assert rec2 is not None and files.status("c2", rec2) == "stopped"
    st = Runc(tmp_path).state("c2")
    assert st is not None and st.status is RuncStatus.STOPPED and st.pid == 0  # `runc state` says 0 then
    assert other.is_dir()


def test_the_unified_hierarchy_freezer(tmp_path: Path) -> None:
    pid, start = _me()
    cg = tmp_path / "cg"
    cg.mkdir()
    write_state(tmp_path, "c1", pid=pid, start=start, cgroups={"": str(cg)})
    files = StateFiles(tmp_path)
    rec = files.record("c1")
    assert rec is not None and rec.unified
    (cg / "cgroup.freeze").write_text("1\n")
    assert files.status("c1", rec) == "paused"
    (cg / "cgroup.freeze").write_text("0\n")
    assert files.status("c1", rec) == "running"


def test_absent_is_none_and_the_cache_follows_the_file(tmp_path: Path) -> None:
    files = StateFiles(tmp_path)
    assert files.record("nope") is None
    assert Runc(tmp_path, binary="/nonexistent/runc").state("nope") is None  # no runc run for that
    pid, start = _me()
    write_state(tmp_path, "c1", pid=pid, start=start)
    first = files.record("c1")
    assert files.record("c1") is first  # cached
    path = tmp_path / "c1" / "state.json"
    data = json.loads(path.read_text())
    data["config"]["rootfs"] = "/elsewhere"
    tmp = path.with_name("state.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # as runc writes it: a new file
    again = files.record("c1")
    assert again is not None and again.rootfs == "/elsewhere"


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"id": "c1"}', b'{"id": "c1", "init_process_pid": "x", "init_process_start": 1, "config": {}}'],
)
def test_what_it_does_not_know_goes_to_runc(tmp_path: Path, content: bytes) -> None:
    d = tmp_path / "c1"
    d.mkdir()
    (d / "state.json").write_bytes(content)
    with pytest.raises(Unreadable):
        StateFiles(tmp_path).record("c1")
    asked: list[str] = []

    class Asking(Runc):
        def state_by_runc(self, container_id: str) -> RuncState | None:
            asked.append(container_id)
            return None

    assert Asking(tmp_path).state("c1") is None and asked == ["c1"]


def test_a_state_file_naming_another_container_is_not_believed(tmp_path: Path) -> None:
    pid, start = _me()
    write_state(tmp_path, "c1", pid=pid, start=start)
    (tmp_path / "c2").mkdir()
    os.replace(tmp_path / "c1" / "state.json", tmp_path / "c2" / "state.json")
    with pytest.raises(Unreadable):
        StateFiles(tmp_path).record("c2")


def test_a_command_name_with_parentheses_does_not_shift_the_fields() -> None:
    # /proc/<pid>/stat's second field is the command name in parentheses, and a process names itself.
    fields = " ".join(["S", "1", "1", "1", "0", "-1", "4194560"] + ["0"] * 12 + ["777"] + ["0"] * 10)
    assert statefile.parse_stat(f"42 (x) S 1 (y) {fields}".encode()) == (777, "S")
    assert statefile.parse_stat(f"42 (a) {fields}".replace(" S ", " Z ", 1).encode()) == (777, "Z")
    with pytest.raises(Unreadable):
        statefile.parse_stat(b"42 (x")
    pid, start = _me()
    assert statefile.proc_start(pid) == (start, "R")
    assert statefile.proc_start(2**22 + 12345) is None


def test_list_falls_back_to_the_state_files_when_runc_list_races_a_deletion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`runc list` fails as a whole when a container goes while it reads; the state files list the rest."""
    from crabd.backends.runc import cli
    from crabd.errors import ContainerRuntimeError

    pid, start = _me()
    for cid in ("i1-a1-g", "i1-b2-g", "i1-c3-g", "i2-x9-g"):
        write_state(tmp_path, cid, pid=pid, start=start)
    (tmp_path / "not a container id").mkdir()
    runc = Runc(tmp_path)
    tries: list[str] = []

    def racing(container_id: str, *args: str, timeout: float | None = None) -> Any:
        tries.append(args[0])
        raise ContainerRuntimeError("runc list : load container i1-zz-g: container does not exist", container="")

    monkeypatch.setattr(runc, "_run", racing)
    real = runc.files.record

    def deleted_meanwhile(cid: str) -> statefile.Record | None:
        if cid == "i1-b2-g":  # runc delete removed it between the listing and the read
            (tmp_path / cid / "state.json").unlink()
            (tmp_path / cid).rmdir()
        return real(cid)

    monkeypatch.setattr(runc.files, "record", deleted_meanwhile)
    monkeypatch.setattr(runc, "state_by_runc", lambda cid: pytest.fail(f"asked runc about {cid}"))
    got = [(st.id, st.status) for st in runc.list("i1-")]
    assert got == [("i1-a1-g", RuncStatus.RUNNING), ("i1-c3-g", RuncStatus.RUNNING)]
    assert tries == ["list"] * cli.LIST_TRIES
    assert Runc(tmp_path / "absent").list() == []


def test_list_passes_on_errors_that_are_not_the_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from crabd.errors import ContainerRuntimeError

    runc = Runc(tmp_path)

    def broken(container_id: str, *args: str, timeout: float | None = None) -> Any:
        raise ContainerRuntimeError("runc list : permission denied", container="")

    monkeypatch.setattr(runc, "_run", broken)
    with pytest.raises(ContainerRuntimeError, match="permission denied"):
        runc.list()
