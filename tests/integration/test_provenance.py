"""Provenance on the real daemon: a full checkpoint with a live process, exported, comes back with its
process into the crabd that made it, and into another crabd (its own host key) with files and session only
until root trusts the first one's key; a forged archive never restores processes; a restore or fork of a
record whose provenance does not verify is refused and changes nothing."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from crabd.sdk import ArchiveRejected, Client, EmbeddedDaemon, ProvenanceRefused, Sandbox
from crabd.trust.keys import PUB_FILE, TRUSTED_DIR
from tests.archive_forge import canonical, rewrite_manifest
from tests.conftest import have_docker, have_root, require
from tests.integration.conftest import start_kept
from tests.integration.test_processes import ASK_REPL, install, start_repl


@pytest.fixture
def repl_sandbox(make_sandbox: Callable[..., Sandbox]) -> Sandbox:
    sb = make_sandbox("bookworm", checkpoints="fs")
    install(sb)
    return sb


def _full_with_process(sb: Sandbox) -> tuple[str, bytes]:
    """A full checkpoint of ``sb`` with the REPL running in its session; (checkpoint id, the REPL's secret)."""
    with sb.turn():
        sb.session.run("mkdir -p /work && cd /work && echo kept > notes && export MODE=signed")
    secret, _ = start_repl(sb)
    return sb.checkpoint(kind="full").id, secret


def _has_process(clone: Sandbox, secret: bytes) -> bool:
    r = clone.session.run(ASK_REPL)
    return r.exit_code == 0 and r.stdout.split()[0] == secret


def _export(c: Client, ck: str) -> bytes:
    out = io.BytesIO()
    c.export_checkpoint(ck, out)
    return out.getvalue()


def test_another_crabd_takes_the_processes_only_once_root_trusts_this_ones_key(
    client: Client, daemon: EmbeddedDaemon, repl_sandbox: Sandbox, kept_state: Path
) -> None:
    require(have_root(), "needs root")
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    ck, secret = _full_with_process(repl_sandbox)
    data = _export(client, ck)
    other = start_kept(kept_state)
    try:
        with Client(other.socket) as c:
            got = c.import_checkpoint(io.BytesIO(data))
            why = got.dropped[ck]
            assert "does not trust" in why and got.checkpoint.kind == "fs"
            clone = c.fork(ck, 1)[0]
            try:
                assert clone.run(["cat", "/work/notes"]).text.strip() == "kept"
                assert clone.session.run("echo $MODE").text.strip() == "signed"
                assert not _has_process(clone, secret)
            finally:
                clone.remove(force=True)
            # Root installs the first crabd's public key: the same archive brings the process.
            c.delete_checkpoint(ck)
            trusted = other.state_dir / "trust" / TRUSTED_DIR / "first.pub"
            shutil.copyfile(daemon.state_dir / "trust" / PUB_FILE, trusted)
            os.chmod(trusted, 0o644)
            got = c.import_checkpoint(io.BytesIO(data))
            assert not got.dropped and got.checkpoint.kind == "full"
            clone = c.fork(ck, 1)[0]
            try:
                assert _has_process(clone, secret)
            finally:
                clone.remove(force=True)
    finally:
        other.close()


def test_a_forged_archive_never_restores_processes(client: Client, repl_sandbox: Sandbox) -> None:
    ck, secret = _full_with_process(repl_sandbox)
    data = _export(client, ck)
    client.delete_checkpoint(ck)
    # A consistent re-pack of a changed record (its spec, one byte longer): the seal and provenance no longer verify.
    forged = rewrite_manifest(
        data, lambda d: d["checkpoints"][0].update(spec_json=d["checkpoints"][0]["spec_json"] + " "), canonical
    )
    assert forged != data
    got = client.import_checkpoint(io.BytesIO(forged))
    assert ck in got.dropped and got.checkpoint.kind == "fs"
    clone = client.fork(ck, 1)[0]
    try:
        assert not _has_process(clone, secret)
    finally:
        clone.remove(force=True)
    client.delete_checkpoint(ck)
    # A byte changed in the process image's blob member: refused whole, nothing imported.
    blob = bytearray(data)
    blob[-2048] ^= 1  # inside the last member's body (the end marker is the last 1024 zero bytes)
    with pytest.raises(ArchiveRejected):
        client.import_checkpoint(io.BytesIO(bytes(blob)))
    assert ck not in {x.id for x in client.checkpoints()}


def test_a_record_changed_behind_crabds_back_is_not_restored(
    client: Client, daemon: EmbeddedDaemon, repl_sandbox: Sandbox
) -> None:
    sb = repl_sandbox
    ck, secret = _full_with_process(sb)
    before = sb.refresh().container_id
    # The same spec in meaning, one byte longer: still not what was signed.
    with contextlib.closing(sqlite3.connect(daemon.state_dir / "registry.db", timeout=30)) as db, db:
        db.execute("UPDATE checkpoints SET spec_json=spec_json || ' ' WHERE id=?", (ck,))
    with pytest.raises(ProvenanceRefused) as err:
        client.fork(ck, 1)
    assert err.value.checkpoint == ck and "spec_json" in err.value.reason
    with pytest.raises(ProvenanceRefused):
        sb.restore(ck)
    # Nothing changed: the same container, its process still answering.
    assert sb.refresh().container_id == before
    assert _has_process(sb, secret)
