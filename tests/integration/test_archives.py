"""Portable checkpoint archives on the real daemon: export -> import -> fork keeps files, session and a live
process; crabctl's export/import; ownership across users; an archive from a newer CRIU imports without its
process image; a broken archive changes nothing; kill -9 at each import crash point leaves nothing half-imported."""

from __future__ import annotations

import grp
import io
import json
import os
import shutil
import sqlite3
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crabd.sdk import ArchiveRejected, Client, EmbeddedDaemon, Sandbox
from crabd.store.archive import MANIFEST_NAME
from crabd.util.faults import CRASH_ENV
from tests.archive_forge import rewrite_manifest
from tests.conftest import CRABCTL, have_docker, have_root, require
from tests.integration.conftest import USER_IN_GROUP, run_as, start_kept
from tests.integration.test_processes import ASK_REPL, install, start_repl


@pytest.fixture
def archive_dir() -> Iterator[Path]:
    """A directory other users can read (pytest's tmp_path is root's only)."""
    d = Path(f"/tmp/crab-archives-{os.getpid()}")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def repl_sandbox(make_sandbox: Callable[..., Sandbox]) -> Sandbox:
    sb = make_sandbox("bookworm", checkpoints="fs")
    install(sb)
    return sb


def _forget(c: Client, ck: str) -> None:
    """Delete a checkpoint so the archive's import brings it back."""
    c.delete_checkpoint(ck)
    assert ck not in {x.id for x in c.checkpoints()}


def test_export_import_fork_keeps_files_session_and_a_live_process(
    client: Client, repl_sandbox: Sandbox, archive_dir: Path
) -> None:
    sb = repl_sandbox
    sb.run(["sh", "-c", "mkdir -p /work && head -c 300000 /dev/urandom > /work/data && ln -s data /work/link"])
    with sb.turn():
        sb.session.run("cd /work && export MODE=exported && answer() { echo 42; }")
    secret, n = start_repl(sb)
    full = sb.checkpoint(kind="full")
    digest = sb.run(["sha256sum", "/work/data"]).text.split()[0]
    path = archive_dir / "full.crab"
    size = client.export_checkpoint(full, path)
    assert size == path.stat().st_size and not Path(str(path) + ".part").exists()
    with tarfile.open(path) as tar:  # `tar tvf` reads it
        assert tar.getnames()[0] == MANIFEST_NAME and all(m.isreg() for m in tar.getmembers())
    _forget(client, full.id)
    got = client.import_checkpoint(path)
    assert got.checkpoint.id == full.id and got.checkpoint.kind == "full" and not got.dropped
    assert got.stored_blobs <= got.blobs and got.bytes == size
    again = client.import_checkpoint(path)  # idempotent
    assert again.checkpoints[0].already_present
    clone = client.fork(full.id, 1)[0]
    try:
        assert clone.run(["sha256sum", "/work/data"]).text.split()[0] == digest
        assert clone.run(["readlink", "/work/link"]).text.strip() == "data"
        assert clone.session.run("echo $MODE $PWD $(answer)").text.strip() == "exported /work 42"
        again_secret, m = clone.session.run(ASK_REPL).stdout.split()
        assert again_secret == secret and int(m) == int(n) + 1  # the REPL's memory came along
    finally:
        clone.remove(force=True)


def _crabctl(socket: str, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "CRAB_SOCKET": socket}
    return subprocess.run([CRABCTL, *args], input=stdin, capture_output=True, env=env, timeout=300)


def test_crabctl_export_and_import_with_ancestors_and_stdio(
    daemon: EmbeddedDaemon, client: Client, make_sandbox: Callable[..., Sandbox], archive_dir: Path
) -> None:
    sb = make_sandbox("busybox", checkpoints="fs")
    for i in range(3):
        with sb.turn():
            sb.run(["sh", "-c", f"echo {i} > /turn"])
    cks = [c.id for c in sb.checkpoints()]
    out = archive_dir / "line.crab"
    done = _crabctl(str(daemon.socket), "checkpoint", "export", cks[-1], "-o", str(out), "--ancestors")
    assert done.returncode == 0, done.stderr
    piped = _crabctl(str(daemon.socket), "checkpoint", "export", cks[-1], "-o", "-")
    assert piped.returncode == 0, piped.stderr
    with tarfile.open(fileobj=io.BytesIO(piped.stdout)) as tar:
        assert tar.getnames()[0] == MANIFEST_NAME
    for ck in reversed(cks):
        client.delete_checkpoint(ck)
    done = _crabctl(str(daemon.socket), "checkpoint", "import", str(out), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [c["checkpoint"]["id"] for c in report["checkpoints"]] == cks
    # Restore to an earlier turn works after the import (its own sandbox still runs here).
    sb.restore(cks[1])
    assert sb.run(["cat", "/turn"]).text.strip() == "0"
    # A truncated archive through stdin: refused, nothing changes.
    before = {c.id for c in client.checkpoints()}
    bad = _crabctl(str(daemon.socket), "checkpoint", "import", "-", stdin=out.read_bytes()[:-20000])
    # Where the cut lands (inside a member, or inside a header: "is truncated") moves with the records' size.
    assert bad.returncode == 1 and (b"the archive ends" in bad.stderr or b"the archive is truncated" in bad.stderr)
    assert {c.id for c in client.checkpoints()} == before


def _forge_criu(src: Path, dst: Path, criu: str) -> None:
    """A real archive whose manifest claims another CRIU (the members rewritten, blobs as they were)."""
    dst.write_bytes(rewrite_manifest(src.read_bytes(), lambda doc: doc.update(criu_version=criu)))


def test_an_archive_from_a_newer_criu_imports_files_and_session_only(
    client: Client, repl_sandbox: Sandbox, archive_dir: Path
) -> None:
    sb = repl_sandbox
    with sb.turn():
        sb.session.run("mkdir -p /work && cd /work && echo kept > notes && export MODE=forged")
    start_repl(sb)
    full = sb.checkpoint(kind="full")
    real, forged = archive_dir / "real.crab", archive_dir / "forged.crab"
    client.export_checkpoint(full, real)
    _forge_criu(real, forged, "99.1.0")
    _forget(client, full.id)
    got = client.import_checkpoint(forged)
    why = got.dropped[full.id]
    assert "CRIU 99.1.0" in why and "older" in why
    assert got.checkpoint.kind == "fs"
    clone = client.fork(full.id, 1)[0]
    try:
        assert clone.run(["cat", "/work/notes"]).text.strip() == "kept"
        assert clone.session.run("echo $MODE $PWD").text.strip() == "forged /work"
        assert clone.session.run(ASK_REPL).exit_code != 0  # no process came along
    finally:
        clone.remove(force=True)


def test_ownership_across_users(
    daemon: EmbeddedDaemon, client: Client, users: dict[str, tuple[int, int]], archive_dir: Path
) -> None:
    sb = client.create("busybox", name="roots-own", checkpoints="fs")
    try:
        sb.run(["sh", "-c", "echo root > /owner"])
        ck = sb.checkpoint()
        path = archive_dir / "roots.crab"
        client.export_checkpoint(ck, path)
        os.chmod(path, 0o644)
        _forget(client, ck.id)
        os.chmod(daemon.base, 0o711)
        uid, gid = users[USER_IN_GROUP]
        crab_gid = grp.getgrnam("crab").gr_gid
        body = f"""
            import io
            attempt("export", lambda: c.export_checkpoint({sb.checkpoints()[0].id!r}, io.BytesIO()))
            attempt("import", lambda: c.import_checkpoint({str(path)!r}).checkpoint.owner_uid)
            attempt("fork", lambda: c.fork({ck.id!r}, 1)[0].run(["cat", "/owner"]).text)
            """
        res = run_as(uid, gid, [crab_gid], daemon.socket, body)
        assert res["export"][0] == "PermissionDenied"  # type: ignore[index]
        assert res["import"][0] == "PermissionDenied"  # type: ignore[index]  # root's sandbox lives here
        assert ck.id not in {c.id for c in client.checkpoints()}
        sb.remove(force=True)
        res = run_as(uid, gid, [crab_gid], daemon.socket, body)
        assert res["import"] == ["ok", uid], res
        assert res["fork"] == ["ok", "root\n"], res
    finally:
        for s in client.list():
            if s.name == "roots-own" or s.info.owner_uid == users[USER_IN_GROUP][0]:
                s.remove(force=True)


# --- kill -9 during an import ------------------------------------------------------------


def _orphans(state: Path) -> list[str]:
    db = sqlite3.connect(f"file:{state / 'registry.db'}?mode=ro", uri=True)
    try:
        live = {str(r[0]) for r in db.execute("SELECT blob FROM blob_refs")}
    finally:
        db.close()
    files = {p.name for p in (state / "blobs" / "sha256").glob("*/*")}
    staged = list((state / "archives").iterdir()) if (state / "archives").exists() else []
    return [f"blob file {b} nothing holds" for b in sorted(files - live)] + [f"staging left: {p}" for p in staged]


@pytest.mark.parametrize("point", ["import.after_stage", "import.before_adopt"])
def test_kill_9_during_an_import_leaves_nothing_half_imported(kept_state: Path, point: str) -> None:
    require(have_root(), "needs root")
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    state = kept_state / "state"
    d = start_kept(kept_state)
    try:
        with Client(d.socket) as c:
            sb = c.create("busybox", name="fa", checkpoints="fs")
            sb.run(["sh", "-c", "head -c 200000 /dev/urandom > /f && echo marker > /marker"])
            ck = sb.checkpoint()
            data = io.BytesIO()
            c.export_checkpoint(ck, data)
            c.delete_checkpoint(ck)
        d.close()
        d = start_kept(kept_state, **{CRASH_ENV: point})
        with Client(d.socket) as c, pytest.raises(Exception):  # noqa: B017 (the daemon dies under the call)
            c.import_checkpoint(io.BytesIO(data.getvalue()))
        assert d.proc is not None
        d.proc.wait(60)
        d.close()
        d = start_kept(kept_state)
        with Client(d.socket) as c:
            assert ck.id not in {x.id for x in c.checkpoints()}
            assert _orphans(state) == []
            got = c.import_checkpoint(io.BytesIO(data.getvalue()))  # redone from scratch
            assert got.checkpoint.id == ck.id and not got.checkpoints[0].already_present
            clone = c.fork(ck.id, 1)[0]
            assert clone.run(["cat", "/marker"]).text == "marker\n"
            clone.remove(force=True)
        with Client(d.socket) as c, pytest.raises(ArchiveRejected):  # a broken archive still changes nothing
            c.import_checkpoint(io.BytesIO(data.getvalue()[:5000]))
        assert _orphans(state) == []
    finally:
        d.close()
