"""Sandbox ids across two real uids on the real daemon: squatting a removed sandbox's id through a forged
archive gets the squatter nothing of the victim's (turn 0, recovery, retention, failures); ImportSandbox of
a record naming another uid's id is refused; a user outside group crab cannot list sandbox ids."""

from __future__ import annotations

import contextlib
import grp
import os
import secrets
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from crabd.backends.runc.cleanup import Layout
from crabd.sdk import Client, CrabError, EmbeddedDaemon, Sandbox
from tests.archive_forge import rewrite_manifest
from tests.integration.conftest import USER_IN_GROUP, USER_OUTSIDE, run_as

SECRET = "victims-secret-7f3a"
FAILURE = "the victim's dump failed: secret-log-line"


def _record_failure(daemon: EmbeddedDaemon, sandbox_id: str, owner_uid: int) -> None:
    """What a failed checkpoint of the victim records (a real CRIU failure is not reproducible on demand)."""
    conn = sqlite3.connect(daemon.state_dir / "registry.db", timeout=30)
    try:
        cols = {str(r[1]) for r in conn.execute("PRAGMA table_info(failures)")}
        if "owner_uid" in cols:
            conn.execute(
                "INSERT INTO failures(sandbox_id, owner_uid, turn, kind, at, error, log_path)"
                " VALUES(?,?,1,'full',1,?,'')",
                (sandbox_id, owner_uid, FAILURE),
            )
        else:
            conn.execute(
                "INSERT INTO failures(sandbox_id, turn, kind, at, error, log_path) VALUES(?,1,'full',1,?,'')",
                (sandbox_id, FAILURE),
            )
        conn.commit()
    finally:
        conn.close()


@pytest.fixture
def victim(client: Client, daemon: EmbeddedDaemon) -> Iterator[tuple[str, list[str]]]:
    """Root's sandbox (a secret in its environment, two turns, a failure record), removed with its
    checkpoints kept: (its id, its checkpoints)."""
    sb = client.create("busybox", name=f"victim-{os.getpid()}", checkpoints="fs", env_vars={"SECRET": SECRET})
    for text in ("one", "two"):
        with sb.turn():
            sb.run(["sh", "-c", f"echo victim-file-{text} > /victim.txt"])
    _record_failure(daemon, sb.id, 0)
    assert FAILURE in {f.error for f in client.checkpoint_failures(sb.name)}
    mine = [c.id for c in client.checkpoints(sb.name)]
    assert len(mine) >= 3
    sb.remove(force=True, keep_checkpoints=True)
    try:
        yield sb.id, mine
    finally:
        for c in reversed(mine):
            with contextlib.suppress(CrabError):  # a test may have deleted it
                client.delete_checkpoint(c)


def _attacker_body(victim_id: str, forged: Path, forged_id: str, tag: str) -> str:
    """The squatter's moves (as crabtest1) with its forged archive: import it, bring the sandbox in, then
    reach for the victim's turn 0, newest checkpoint, kept checkpoints (retention) and failure records."""
    return f"""
        from crabd.sdk import RetentionPolicy
        attempt("import", lambda: [x.checkpoint.sandbox_id for x in c.import_checkpoint({str(forged)!r}).checkpoints])
        attempt("arrive", lambda: c.import_sandbox({forged_id!r}).sandbox.id)
        sq = c.get("sq-{tag}")
        def turn0():
            sq.restore(turn=0)
            return sq.run(["sh", "-c", "echo $SECRET; cat /victim.txt 2>/dev/null"]).text
        attempt("turn0", turn0)
        attempt("rm_head", lambda: c.delete_checkpoint({forged_id!r}))
        attempt("stop", lambda: sq.stop().state)
        attempt("recover", lambda: sq.recover().checkpoint)
        attempt("policy", lambda: c.set_retention("sq-{tag}", RetentionPolicy(keep_last=1)).name)
        attempt("thin", lambda: c.thin("sq-{tag}").deleted)
        attempt("failures", lambda: [f.error for f in c.checkpoint_failures("sq-{tag}")])
        attempt("all_failures", lambda: [f.error for f in c.checkpoint_failures()])
        attempt("tree", lambda: [n.id for n in c.tree(sandbox="sq-{tag}").checkpoints])
        """


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the second user can write its export into (pytest's tmp_path is root's only)."""
    d = Path(f"/tmp/crab-identity-{os.getpid()}")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_squatting_a_removed_sandbox_id_gets_nothing_of_the_victim(
    daemon: EmbeddedDaemon,
    client: Client,
    users: dict[str, tuple[int, int]],
    victim: tuple[str, list[str]],
    shared_dir: Path,
) -> None:
    vid, theirs = victim
    os.chmod(daemon.base, 0o711)
    uid, gid = users[USER_IN_GROUP]
    groups = [grp.getgrnam("crab").gr_gid]
    tag = str(os.getpid())
    own = shared_dir / "own.crab"
    try:
        made = run_as(
            uid,
            gid,
            groups,
            daemon.socket,
            f"""
            sb = c.create("busybox", name="att-{tag}", checkpoints="fs")
            attempt("export", lambda: c.export_checkpoint(sb.checkpoint().id, {str(own)!r}))
            """,
        )
        assert made["export"][0] == "ok", made  # type: ignore[index]
        # The forged archive: the squatter's own checkpoint, renamed, claiming the victim's sandbox id.
        forged_id = "ck-" + secrets.token_hex(6)
        forged = shared_dir / "forged.crab"

        def change(doc: dict[str, Any]) -> None:
            doc["checkpoints"][0].update(id=forged_id, sandbox_id=vid, sandbox_name=f"sq-{tag}")

        forged.write_bytes(rewrite_manifest(own.read_bytes(), change))
        os.chmod(forged, 0o644)
        res = run_as(uid, gid, groups, daemon.socket, _attacker_body(vid, forged, forged_id, tag))
        # The import succeeded, under a fresh id; the sandbox brought in has that id, not the victim's.
        assert res["import"][0] == "ok" and vid not in res["import"][1], res  # type: ignore[index]
        assert res["arrive"][0] == "ok" and res["arrive"][1] != vid, res  # type: ignore[index]
        # Turn 0 is not the victim's creation checkpoint: no secret, no files of theirs.
        assert res["turn0"][0] == "InvalidRequest" or SECRET not in str(res["turn0"][1]), res  # type: ignore[index]
        assert "victim-file" not in str(res["turn0"]), res
        # Recovery after the head is gone does not pick the victim's newest checkpoint.
        assert res["recover"][0] != "ok" or res["recover"][1] not in theirs, res  # type: ignore[index]
        # Retention on the squatter's sandbox thinned none of the victim's kept checkpoints.
        assert res["policy"][0] == "ok", res  # type: ignore[index]
        assert not set(theirs) & set(res["thin"][1] if res["thin"][0] == "ok" else []), res  # type: ignore[index]
        assert set(theirs) <= {c.id for c in client.checkpoints()}
        # Failure records and the tree show nothing of the victim.
        assert FAILURE not in str(res["failures"]) and FAILURE not in str(res["all_failures"]), res
        assert not set(theirs) & set(res["tree"][1] if res["tree"][0] == "ok" else []), res  # type: ignore[index]
        assert vid not in {s.id for s in client.list()}
    finally:
        for s in client.list():
            if s.info.owner_uid == uid:
                s.remove(force=True)
        for c in client.checkpoints():
            if c.owner_uid == uid:
                client.delete_checkpoint(c.id)


def test_import_sandbox_naming_another_uids_id_is_refused(
    daemon: EmbeddedDaemon,
    client: Client,
    users: dict[str, tuple[int, int]],
    victim: tuple[str, list[str]],
) -> None:
    """A record that names the victim's id as the importer's (as a bucket object, or a catalog from before
    the id ledger, can) is refused by ImportSandbox, and no sandbox takes the id."""
    vid, theirs = victim
    os.chmod(daemon.base, 0o711)
    uid, gid = users[USER_IN_GROUP]
    crab_gid = grp.getgrnam("crab").gr_gid
    tag = str(os.getpid())
    try:
        made = run_as(
            uid,
            gid,
            [crab_gid],
            daemon.socket,
            f"""
            own = c.create("busybox", name="own-{tag}", checkpoints="fs")
            attempt("ck", lambda: own.checkpoint().id)
            own.remove(force=True, keep_checkpoints=True)
            """,
        )
        assert made["ck"][0] == "ok", made  # type: ignore[index]
        ck = str(made["ck"][1])  # type: ignore[index]
        conn = sqlite3.connect(daemon.state_dir / "registry.db", timeout=30)
        try:
            conn.execute("UPDATE checkpoints SET sandbox_id=? WHERE id=?", (vid, ck))
            conn.commit()
        finally:
            conn.close()
        res = run_as(
            uid, gid, [crab_gid], daemon.socket, f'attempt("arrive", lambda: c.import_sandbox({ck!r}).sandbox.id)'
        )
        assert res["arrive"][0] == "PermissionDenied", res  # type: ignore[index]
        assert "another uid" in str(res["arrive"][1])  # type: ignore[index]
        assert vid not in {s.id for s in client.list()}
        assert set(theirs) <= {c.id for c in client.checkpoints()}
    finally:
        for s in client.list():
            if s.info.owner_uid == uid:
                s.remove(force=True)
        for c in client.checkpoints():
            if c.owner_uid == uid:
                client.delete_checkpoint(c.id)


def test_a_user_outside_group_crab_cannot_list_sandbox_ids(
    daemon: EmbeddedDaemon, make_sandbox: Callable[..., Sandbox], users: dict[str, tuple[int, int]]
) -> None:
    sb = make_sandbox("busybox", checkpoints="none")
    layout = Layout()
    if not any(sb.id in p.name for p in layout.netns.iterdir()):
        pytest.fail(f"the daemon does not run sandboxes on the runc backend (no netns of {sb.id} in {layout.netns})")
    uid, gid = users[USER_OUTSIDE]
    in_uid, in_gid = users[USER_IN_GROUP]
    crab_gid = grp.getgrnam("crab").gr_gid
    dirs = [layout.netns, layout.bundles, layout.runc_root, daemon.state_dir]
    probe = f"""
        out = {{}}
        for d in {[str(d) for d in dirs]!r}:
            try:
                out[d] = sorted(os.listdir(d))
            except PermissionError:
                out[d] = "denied"
        print(json.dumps(out))
        """
    for who, (u, g, groups) in {"outside": (uid, gid, []), "member": (in_uid, in_gid, [crab_gid])}.items():
        seen = _listdirs_as(u, g, groups, probe)
        for d in dirs:
            assert seen[str(d)] == "denied", (who, d, seen[str(d)])


def _listdirs_as(uid: int, gid: int, groups: list[int], probe: str) -> dict[str, object]:
    import json
    import subprocess
    import sys
    import textwrap

    # Modules load before the uid drops: the interpreter's library is root's only here.
    script = f"import json, os\nos.setgroups({groups!r}); os.setgid({gid}); os.setuid({uid})\n" + textwrap.dedent(probe)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
