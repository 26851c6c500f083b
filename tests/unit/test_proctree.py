"""Killing a helper's whole process tree (crabd/util/proctree.py, proc.run(kill_tree=True)) and cgroup removal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from crabd.errors import CommandTimeout
from crabd.util import cgroups, proc, proctree
from tests.conftest import REPO

#: A helper that forks a child, a grandchild in a session of its own (as CRIU's restored tasks are), then hangs.
TREE = "setsid sleep 61 & echo $! >> {f}; (sleep 62 & echo $! >> {f}; wait) & echo $! >> {f}; exec sleep 63"


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _pids(f: Path) -> list[int]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pids = [int(x) for x in f.read_text().split()] if f.exists() else []
        if len(pids) >= 3:
            return pids
        time.sleep(0.02)
    raise AssertionError("the helper did not start its children")


def test_members_takes_descendants_and_the_session() -> None:
    procs = {
        10: (1, 10),  # the helper, its session's leader
        11: (10, 10),
        12: (11, 12),  # a grandchild that called setsid
        13: (1, 10),  # an orphan of the session (its parent died): reparented away
        14: (13, 14),
        20: (1, 20),  # unrelated
        21: (20, 20),
    }
    assert proctree.members(procs, 10) == {10, 11, 12}
    assert proctree.members(procs, 10, session=10) == {10, 11, 12, 13, 14}
    assert proctree.members(procs, None, session=10) == {10, 11, 12, 13, 14}
    assert proctree.members(procs, 99) == set()


def test_a_timed_out_helper_is_killed_with_its_whole_tree(tmp_path: Path) -> None:
    f = tmp_path / "pids"
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout):
        proc.run(["sh", "-c", TREE.format(f=f)], timeout=0.5, kill_tree=True)
    assert time.monotonic() - t0 < 5
    assert [p for p in _pids(f) if _alive(p)] == []


def test_a_failed_helper_leaves_nothing_of_its_session(tmp_path: Path) -> None:
    f = tmp_path / "pids"
    script = "sleep 61 & echo $! >> {f}; sleep 62 & echo $! >> {f}; sleep 63 & echo $! >> {f}; exit 3"
    # Not captured, as runc's detached calls run (a pipe would wait for the children's EOF).
    done = proc.run(["sh", "-c", script.format(f=f)], timeout=10, check=False, capture=False, kill_tree=True)
    assert done.exit_code == 3
    assert [p for p in _pids(f) if _alive(p)] == []


def test_a_successful_helper_s_detached_children_are_not_touched(tmp_path: Path) -> None:
    """Only a failure sweeps the session: ``runc run -d`` leaves a container running on success."""
    f = tmp_path / "pids"
    script = "for i in 1 2 3; do setsid sleep 61 & echo $! >> {f}; done"
    proc.run(["sh", "-c", script.format(f=f)], timeout=10, capture=False, kill_tree=True)
    pids = _pids(f)
    try:
        assert all(_alive(p) for p in pids)
    finally:
        proctree.kill_pids(pids)
    assert [p for p in pids if _alive(p)] == []


#: Run as crabd is (a child subreaper): after a timed-out helper, no child of this process is left, zombie or not.
SUBREAPER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from crabd.backends.runc import reaper
    from crabd.errors import CommandTimeout
    from crabd.util import proc
    reaper.become_subreaper()
    t0 = time.monotonic()
    try:
        proc.run(["sh", "-c", sys.argv[1]], timeout=0.5, kill_tree=True)
    except CommandTimeout:
        pass
    took = time.monotonic() - t0
    me = str(os.getpid())
    kids = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                st = dict(l.split(":", 1) for l in Path(f"/proc/{e}/status").read_text().splitlines() if ":" in l)
            except OSError:
                continue
            if st.get("PPid", "").strip() == me:
                kids.append((int(e), st["State"].strip()))
    print(json.dumps({"took": took, "children": kids}))
    """
)


def test_as_a_subreaper_nothing_is_left_to_reap(tmp_path: Path) -> None:
    f = tmp_path / "pids"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", SUBREAPER, TREE.format(f=f)], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["took"] < 5
    assert got["children"] == []  # every orphan was killed and reaped here, none is a zombie
    assert [p for p in _pids(f) if _alive(p)] == []


def test_container_dirs_and_their_removal_deepest_first(tmp_path: Path) -> None:
    cid = "inst-sb-abc"
    for hierarchy in ("freezer", "memory", "unified"):
        (tmp_path / hierarchy / "crab" / cid / "nested" / "deeper").mkdir(parents=True)
    (tmp_path / "pids" / "crab" / "other").mkdir(parents=True)
    (tmp_path / "cpuacct").symlink_to(tmp_path / "memory")  # one hierarchy under two names: listed once
    dirs = cgroups.container_dirs(cid, root=tmp_path)
    assert len(dirs) == 9
    assert dirs[0].name == "deeper" and dirs[-1].name == cid
    assert cgroups.kill_all(cid, root=tmp_path) == []
    assert cgroups.container_dirs(cid, root=tmp_path) == []
    assert (tmp_path / "pids" / "crab" / "other").is_dir()  # another container's: untouched
    assert cgroups.kill_all("nothing-here-x", root=tmp_path) == []
