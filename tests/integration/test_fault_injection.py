"""The fault-injection walk (issue 17, build 7): crabd killed at every named point, and ENOSPC at every write point.

For each crash point of ``crabd/util/faults.py``: a crabd armed with
``CRAB_CRASH_AT=<point>`` drives the operation that reaches it and dies
there (SIGKILL: no cleanup runs); a crabd without the knob then starts on
the same state dir, and the walk checks that

* ``crabctl verify`` is clean;
* every listed sandbox runs and answers a command;
* every listed checkpoint restores (its own sandbox) or forks (a removed one's);
* nothing is orphaned: no container of this daemon that no sandbox names, no
  file in the store's ``tmp/`` or under ``run/dumps``, no mount under the
  state dir, no blob file the catalog does not hold live, no head or
  ``creating`` row of a sandbox that is gone; on the runc backend (the
  default where the host has it) no runc container, bundle, netns, CNI
  result or subvolume that no sandbox names, and no btrfs snapshot of a
  checkpoint the catalog does not have.

Then the same with ENOSPC injected at each write point: the operation fails
with a clear error, the sandbox keeps running, and the same checks hold.

Every point runs in one test function on one state dir (crabd start-up is
the cost); failures are collected and reported together, per point.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crabd.sdk import Client, CrabError, RetentionPolicy, StoreFull
from crabd.util.faults import CRASH_ENV, CRASH_POINTS, FAIL_ENV, WRITE_POINTS
from tests.conftest import CRABCTL, have_docker, have_root, require
from tests.integration.conftest import (
    instance_containers,
    instance_snapshots,
    kill_container,
    remove_instance_containers,
    start_kept,
)


@pytest.fixture
def walk_dir() -> Iterator[Path]:
    require(have_root(), "needs root")
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    base = Path(f"/tmp/crab-faults-{os.getpid()}")
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o700)
    try:
        yield base
    finally:
        remove_instance_containers(base / "state")
        shutil.rmtree(base, ignore_errors=True)


class Walk:
    """One state dir, the sandbox "fa" every point works on, and what was already checked."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.state = base / "state"
        self.restored: set[str] = set()
        #: Checkpoints of sandboxes removed with keep_checkpoints: they must survive.
        self.kept: set[str] = set()
        self.n = 0

    def fresh_file(self, c: Client) -> None:
        self.n += 1
        c.get("fa").run(["sh", "-c", f"head -c 20000 /dev/urandom > /f{self.n}; echo {self.n} > /n"])

    def stray_blob(self) -> None:
        """A blob file no checkpoint references (what gc removes)."""
        src = next(p for p in (self.state / "blobs" / "sha256").glob("*/*") if p.is_file())
        fake = "f" * 63 + str(self.n % 10)
        (src.parent.parent / fake[:2]).mkdir(exist_ok=True)
        shutil.copyfile(src, src.parent.parent / fake[:2] / fake)

    # --- the checks -------------------------------------------------------------------

    def check(self, c: Client, point: str) -> list[str]:
        # The store first, as the restart left it (the restores below replace
        # stat indexes, whose blobs a running crabd sweeps at its next delete).
        problems = self.orphans(c, store=True)
        env = {**os.environ, "CRAB_SOCKET": str(self.base / "crabd.sock")}
        done = subprocess.run([CRABCTL, "verify", "--json"], capture_output=True, text=True, env=env, timeout=300)
        if done.returncode != 0:
            problems.append(f"crabctl verify: rc={done.returncode} {done.stdout.strip()[:300]} {done.stderr[-300:]}")
        for sb in c.list():
            if sb.info.state == "dead" and point.startswith("recover."):
                sb.recover()  # the crash hit a recovery: the sandbox is still dead, and recovers now
            elif sb.info.state != "running":
                problems.append(f"sandbox {sb.name} is {sb.info.state} ({sb.info.dead_reason})")
                continue
            try:
                res = sb.run(["cat", "/marker"], timeout=20)
                if res.exit_code != 0 and sb.name == "fa":
                    problems.append(f"sandbox fa lost /marker: {res.stderr!r}")
            except CrabError as exc:
                problems.append(f"sandbox {sb.name} unusable: {type(exc).__name__}: {exc}")
        names = {sb.info.id: sb for sb in c.list()}
        # What the crash left is what is checked: a retention policy (the thin.* points' sandbox) would
        # otherwise thin the checkpoints the restores below leave behind (each restore moves the head).
        for sb in names.values():
            if sb.info.retention is not None:
                c.set_retention(sb.name, None)
        listed = {ck.id for ck in c.checkpoints()}
        if self.kept - listed:
            problems.append(f"kept checkpoints of a removed sandbox lost: {sorted(self.kept - listed)}")
        for ck in c.checkpoints():
            if ck.id in self.restored:
                continue
            try:
                if ck.sandbox_id in names:
                    sb = names[ck.sandbox_id]
                    sb.restore(ck)
                    if sb.run(["true"], timeout=20).exit_code != 0:
                        problems.append(f"checkpoint {ck.id}: restored sandbox does not run a command")
                else:
                    for clone in c.fork(ck, 1, name_prefix=f"chk{self.n}-{ck.id[-4:]}"):
                        clone.remove(force=True)
                self.restored.add(ck.id)
            except CrabError as exc:
                problems.append(f"checkpoint {ck.id} ({ck.label or ck.kind}) does not restore: {exc}")
        problems += self.orphans(c, store=False)
        return problems

    def orphans(self, c: Client, *, store: bool) -> list[str]:
        problems: list[str] = []
        known = {sb.info.container_id for sb in c.list()}
        extra: set[str] = set()
        for _ in range(50):  # a restore removes the replaced container in the background
            extra = instance_containers(self.state) - known
            if not extra:
                break
            time.sleep(0.2)
        if extra:
            problems.append(f"containers no sandbox names: {sorted(x[:12] for x in extra)}")
        for d in (self.state / "blobs" / "tmp", self.state / "run" / "dumps", self.state / "archives"):
            left = sorted(p.name for p in d.iterdir()) if d.exists() else []
            if left:
                problems.append(f"files left in {d.relative_to(self.state)}: {left[:5]}")
        with open("/proc/mounts") as f:
            mounts = [line.split()[1] for line in f if str(self.base) in line]
        if mounts:
            problems.append(f"mounts under the state dir: {mounts}")
        if not store:
            return problems
        db = sqlite3.connect(f"file:{self.state / 'registry.db'}?mode=ro", uri=True)
        try:
            live = {str(r[0]) for r in db.execute("SELECT blob FROM blob_refs")}
            heads = [
                str(r[0])
                for r in db.execute("SELECT sandbox_id FROM heads WHERE sandbox_id NOT IN (SELECT id FROM sandboxes)")
            ]
            creating = [str(r[0]) for r in db.execute("SELECT name FROM sandboxes WHERE state='creating'")]
            checkpoints = {str(r[0]) for r in db.execute("SELECT id FROM checkpoints")}
        finally:
            db.close()
        # The runc backend's snapshots follow the catalog: one per published checkpoint at most.
        snapshots = instance_snapshots(self.state)
        if snapshots - checkpoints:
            problems.append(f"snapshots of no checkpoint: {sorted(snapshots - checkpoints)}")
        files = {p.name for p in (self.state / "blobs" / "sha256").glob("*/*") if p.is_file()}
        if files - live:
            problems.append(f"{len(files - live)} blob file(s) nothing references, e.g. {sorted(files - live)[0][:16]}")
        if live - files:
            problems.append(f"{len(live - files)} live blob(s) without a file")
        if heads:
            problems.append(f"heads of removed sandboxes: {heads}")
        if creating:
            problems.append(f"sandboxes left in state creating: {creating}")
        return problems

    def tidy(self, c: Client) -> None:
        """Only "fa" goes on to the next point (fewer sandboxes to check)."""
        for sb in c.list():
            if sb.name != "fa":
                sb.remove(force=True)


def _drivers(w: Walk) -> dict[str, Callable[[Client], object]]:
    """The operation that reaches each point (run against the armed daemon)."""

    def checkpoint(kind: str = "") -> Callable[[Client], object]:
        def go(c: Client) -> object:
            w.fresh_file(c)
            return c.get("fa").checkpoint(kind=kind)

        return go

    def restore(c: Client) -> object:
        sb = c.get("fa")
        return sb.restore(sb.checkpoints()[-2])

    def fork(c: Client) -> object:
        return c.fork(c.get("fa").checkpoints()[-1], 1, name_prefix=f"fork{w.n}")

    def recover(c: Client) -> object:
        sb = c.get("fa")
        kill_container(sb.info.container_id)
        for _ in range(100):
            if sb.refresh().state == "dead":
                break
            time.sleep(0.1)
        return sb.recover()

    def delete(c: Client) -> object:
        # A checkpoint whose file only it holds, so deleting it frees blobs.
        sb = c.get("fa")
        w.fresh_file(c)
        doomed = sb.checkpoint(label="doomed")
        sb.run(["sh", "-c", f"rm /f{w.n}"])
        sb.checkpoint()
        return c.delete_checkpoint(doomed)

    def import_(c: Client) -> object:
        # Export a fresh checkpoint of "fa", forget it, and bring it back from its archive.
        w.fresh_file(c)
        ck = c.get("fa").checkpoint(label="archived")
        data = io.BytesIO()
        c.export_checkpoint(ck, data)
        c.delete_checkpoint(ck)
        return c.import_checkpoint(io.BytesIO(data.getvalue()))

    def gc(c: Client) -> object:
        w.stray_blob()
        return c.gc()

    def remove(keep: bool) -> Callable[[Client], object]:
        def go(c: Client) -> object:
            w.n += 1
            victim = c.create("busybox", name=f"victim{w.n}")
            victim.run(["sh", "-c", "echo v > /v"])
            ck = victim.checkpoint()
            if keep:
                w.kept.add(ck.id)
            victim.remove(force=True, keep_checkpoints=keep)
            return None

        return go

    def thin(c: Client) -> object:
        # A sandbox of its own (tidy removes it): its policy must not thin "fa" under later points.
        w.n += 1
        sb = c.create("busybox", name=f"thin{w.n}")
        for i in range(4):
            sb.run(["sh", "-c", f"head -c 20000 /dev/urandom > /t{i}"])
            sb.checkpoint()
        # Setting the policy queues a background thinning; it reaches the same points as the call below.
        c.set_retention(sb.name, RetentionPolicy(keep_last=1))
        return c.thin(sb.name)

    drive: dict[str, Callable[[Client], object]] = {}
    for p in CRASH_POINTS:
        if p.startswith("checkpoint."):
            drive[p] = checkpoint("full" if p == "checkpoint.after_dump" else "")
    drive.update(
        {
            "blobs.before_rename": checkpoint(),
            "restore.after_materialize": restore,
            "restore.after_launch": restore,
            "restore.before_swap": restore,
            "restore.after_swap": restore,
            "fork.after_reserve": fork,
            "fork.after_launch": fork,
            "fork.after_commit": fork,
            "recover.before_restore": recover,
            "delete.after_catalog": delete,
            "sweep.mid": delete,
            "gc.mid": gc,
            "import.after_stage": import_,
            "import.before_adopt": import_,
            "thin.in_transaction": thin,
            "thin.after_catalog": thin,
            "thin.sweep": thin,
            "remove.after_container": remove(False),
            "remove.before_forget": remove(True),
            "blobs.write": checkpoint(),
            "blobs.sync": checkpoint(),
            "restore.materialize": restore,
            "checkpoint.dump": checkpoint("full"),
        }
    )
    return drive


def test_fault_injection_walk(walk_dir: Path) -> None:
    w = Walk(walk_dir)
    drive = _drivers(w)
    assert set(CRASH_POINTS) | set(WRITE_POINTS) <= set(drive), "a point without a driver is never tested"
    d = start_kept(walk_dir)
    with Client(d.socket) as c:
        sb = c.create("busybox", name="fa")
        sb.run(["sh", "-c", "echo marker > /marker"])
        sb.checkpoint(label="marked")
    failures: dict[str, list[str]] = {}
    timings: dict[str, float] = {}
    errors: dict[str, str] = {}
    try:
        for point in CRASH_POINTS:
            t0 = time.monotonic()
            d.close()
            d = start_kept(walk_dir, **{CRASH_ENV: point})
            with Client(d.socket) as c, contextlib.suppress(CrabError):  # the daemon died under the call
                drive[point](c)
            assert d.proc is not None
            try:
                d.proc.wait(60)
            except subprocess.TimeoutExpired:
                failures[point] = ["the operation never reached the point (crabd still alive)"]
            d.close()
            d = start_kept(walk_dir)
            with Client(d.socket) as c:
                problems = w.check(c, point)
                w.tidy(c)
            if problems:
                failures[point] = failures.get(point, []) + problems
            timings[point] = time.monotonic() - t0
        for point in WRITE_POINTS:
            t0 = time.monotonic()
            d.close()
            d = start_kept(walk_dir, **{FAIL_ENV: f"{point}:ENOSPC"})
            problems = []
            with Client(d.socket) as c:
                try:
                    drive[point](c)
                    problems.append("the operation succeeded despite ENOSPC")
                except CrabError as exc:
                    text = f"{type(exc).__name__}: {exc}"
                    errors[point] = text
                    if not isinstance(exc, StoreFull) or "no space" not in text.lower():
                        problems.append(f"unclear error: {text[:300]}")
                with contextlib.suppress(CrabError):
                    if c.get("fa").run(["cat", "/marker"], timeout=20).exit_code != 0:
                        problems.append("fa lost /marker after the failed operation")
            d.close()
            d = start_kept(walk_dir)
            with Client(d.socket) as c:
                problems += w.check(c, point)
                w.tidy(c)
            if problems:
                failures[f"{point}:ENOSPC"] = problems
            timings[f"{point}:ENOSPC"] = time.monotonic() - t0
    finally:
        d.close()
    report = {
        "points": len(CRASH_POINTS) + len(WRITE_POINTS),
        "failures": failures,
        "enospc": errors,
        "seconds": timings,
    }
    print(json.dumps(report, indent=1))
    assert not failures, json.dumps(failures, indent=1)
