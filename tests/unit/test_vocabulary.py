"""crab's typed vocabulary: the enums keep the wire, database and JSON spellings; bad words stop at the edge."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from crabd.api import convert
from crabd.api.v1 import crab_pb2 as pb
from crabd.coordinator.housekeeping import Contents
from crabd.coordinator.sessionkeep import CaptureCounts
from crabd.errors import ConfigError, CrabError, InvalidRequest
from crabd.inspector.model import Decision
from crabd.inspector.vouched import VouchedProcesses
from crabd.models import (
    Caller,
    CheckpointKind,
    CheckpointPolicy,
    CheckpointRecord,
    DecisionKind,
    FilesSource,
    InspectorMode,
    RecoveryMode,
    SandboxRecord,
    SandboxSpec,
    SandboxState,
    ShardPlace,
    TurnCheckpointState,
    Vocabulary,
)
from crabd.sdk.models import SandboxInfo
from crabd.service.remote import RemoteCheckpoints
from crabd.service.reports import CheckpointDetail, DaemonStatus, EngineReport
from crabd.service.service import Service
from crabd.store.catalog import Catalog, CheckpointFailure, LiveBlob
from crabd.store.db import Database
from crabd.store.registry import Registry, spec_from_json, spec_to_json

ROOT = Caller(uid=0, gid=0, pid=1)

# The spellings crabd's API, CLI, database and JSON have always used: renaming a member is
# fine, changing one of these strings breaks old databases and other versions' clients.
SPELLINGS: dict[type[Vocabulary], list[str]] = {
    CheckpointKind: ["fs", "full"],
    DecisionKind: ["skip", "fs", "full"],
    CheckpointPolicy: ["auto", "fs", "full", "none"],
    RecoveryMode: ["manual", "auto"],
    TurnCheckpointState: ["pending", "done", "skipped", "failed", "lost", "none"],
    InspectorMode: ["auto", "ebpf", "scan"],
}


@pytest.mark.parametrize("vocab", list(SPELLINGS), ids=lambda v: v.__name__)
def test_enum_values_are_the_strings_crab_always_used(vocab: type[Vocabulary]) -> None:
    assert [m.value for m in vocab] == SPELLINGS[vocab]
    for member in vocab:
        assert member == member.value and str(member) == member.value and f"{member}" == member.value
        assert json.dumps(member) == f'"{member.value}"'
        assert vocab.parse(member.value) is member


def test_parse_rejects_an_unknown_word_with_a_clear_crab_error() -> None:
    with pytest.raises(InvalidRequest) as got:
        CheckpointPolicy.parse("sometimes")
    assert isinstance(got.value, CrabError)
    assert got.value.message == "unknown checkpoint policy 'sometimes'; use one of auto, fs, full, none"
    with pytest.raises(InvalidRequest, match="unknown checkpoint kind 'both'; use one of fs, full"):
        CheckpointKind.parse("both")
    with pytest.raises(InvalidRequest, match="unknown recovery policy 'never'; use one of manual, auto"):
        RecoveryMode.parse("never")
    with pytest.raises(InvalidRequest):
        CheckpointKind.parse("FS")  # the spelling is exact, as it always was


def test_a_skip_decision_takes_no_checkpoint() -> None:
    assert DecisionKind.FS.checkpoint_kind() is CheckpointKind.FS
    assert DecisionKind.FULL.checkpoint_kind() is CheckpointKind.FULL
    with pytest.raises(ValueError):
        DecisionKind.SKIP.checkpoint_kind()


# --- the formats do not change ---------------------------------------------------------------


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    with Database(tmp_path / "registry.db") as d:
        yield d


def _checkpoint(kind: CheckpointKind) -> CheckpointRecord:
    return CheckpointRecord(
        id="ck-1", sandbox_id="sb", sandbox_name="sb", owner_uid=0, parent_id=None, branch=0, turn=1, kind=kind,
        created_at=1.0, label="", image="img", spec_json="{}", index_blob="i", delta_blob="d",
    )  # fmt: skip


def _raw(db: Database, sql: str) -> object:
    with db.lock:
        row = db.conn.execute(sql).fetchone()
    assert row is not None
    return row[0]


def test_sqlite_keeps_the_strings_and_gives_back_members(db: Database) -> None:
    cat, reg = Catalog(db), Registry(db)
    cat.publish(_checkpoint(CheckpointKind.FULL), lambda _b: set(), lambda _b: (0, 0))
    raw_kind = _raw(db, "SELECT kind FROM checkpoints WHERE id='ck-1'")
    assert type(raw_kind) is str and raw_kind == "full"
    found = cat.find("ck-1")
    assert found is not None and found.kind is CheckpointKind.FULL
    assert cat.live_blobs() == {"i": LiveBlob(1, 0, 0), "d": LiveBlob(1, 0, 0)}

    spec = SandboxSpec(env="busybox", checkpoints=CheckpointPolicy.FS, recovery=RecoveryMode.AUTO)
    reg.insert_sandbox(SandboxRecord("sb", "sb", 0, spec, "img", "c", SandboxState.RUNNING, 1.0))
    stored = json.loads(str(_raw(db, "SELECT spec_json FROM sandboxes WHERE id='sb'")))
    assert stored["checkpoints"] == "fs" and stored["recovery"] == "auto"
    got = reg.get_sandbox("sb")
    assert got is not None
    assert got.spec.checkpoints is CheckpointPolicy.FS and got.spec.recovery is RecoveryMode.AUTO

    t = reg.open_turn("sb", 2.0, implicit=False)
    reg.close_turn("sb", t.number, 3.0, None)
    reg.set_turn_checkpoint("sb", t.number, TurnCheckpointState.SKIPPED, basis_id="ck-1")
    assert _raw(db, "SELECT checkpoint_state FROM turns WHERE sandbox_id='sb'") == "skipped"
    [turn] = reg.list_turns("sb")
    assert turn.checkpoint_state is TurnCheckpointState.SKIPPED

    cat.record_failure("sb", 4, CheckpointKind.FS, "no space", "")
    assert _raw(db, "SELECT kind FROM failures") == "fs"


def test_pending_turn_checkpoints_end_done_or_lost_in_the_same_spelling(db: Database) -> None:
    cat, reg = Catalog(db), Registry(db)
    reg.insert_sandbox(SandboxRecord("sb", "sb", 0, SandboxSpec(env="busybox"), "img", "c", SandboxState.RUNNING, 0.0))
    for _ in range(2):
        t = reg.open_turn("sb", 0.5, implicit=False)
        reg.close_turn("sb", t.number, 0.5, None)
        reg.set_turn_checkpoint("sb", t.number, TurnCheckpointState.PENDING)
    cat.publish(_checkpoint(CheckpointKind.FS), lambda _b: set(), lambda _b: (0, 0))  # turn 1's, published
    assert reg.lose_pending_turns("crabd stopped") == 1
    with db.lock:
        rows = db.conn.execute("SELECT number, checkpoint_state FROM turns ORDER BY number").fetchall()
    assert rows == [(1, "done"), (2, "lost")]
    assert [t.checkpoint_state for t in reg.list_turns("sb")] == [
        TurnCheckpointState.DONE,
        TurnCheckpointState.LOST,
    ]


def test_sandbox_spec_json_is_unchanged_and_old_specs_still_load() -> None:
    spec = SandboxSpec(env="busybox", checkpoints=CheckpointPolicy.NONE, recovery=RecoveryMode.MANUAL)
    text = spec_to_json(spec)
    assert '"checkpoints": "none"' in text and '"recovery": "manual"' in text
    assert spec_from_json(text) == spec
    # A spec stored before recovery policies existed.
    old = spec_from_json(json.dumps({"env": "busybox", "checkpoints": "full"}))
    assert old.checkpoints is CheckpointPolicy.FULL and old.recovery is RecoveryMode.MANUAL


def test_parsed_specs_are_cached_but_no_caller_shares_their_environment() -> None:
    text = spec_to_json(SandboxSpec(env="busybox", env_vars={"A": "1"}))
    first = spec_from_json(text)
    first.env_vars["B"] = "2"  # a caller filling in its own copy
    second = spec_from_json(text)
    assert second.env_vars == {"A": "1"} and second.env_vars is not first.env_vars
    assert second == SandboxSpec(env="busybox", env_vars={"A": "1"})


def test_decision_json_is_unchanged() -> None:
    d = Decision(DecisionKind.SKIP, ["nothing changed"], "scan")
    assert json.loads(d.to_json())["kind"] == "skip"
    back = Decision.from_json(d.to_json())
    assert back == d and back.kind is DecisionKind.SKIP


def test_proto_fields_carry_the_same_strings() -> None:
    spec = SandboxSpec(env="busybox", checkpoints=CheckpointPolicy.FULL, recovery=RecoveryMode.AUTO)
    m = convert.sandbox_to_pb(SandboxRecord("sb", "sb", 0, spec, "img", "c", SandboxState.RUNNING, 1.0))
    assert (m.checkpoints, m.recovery) == ("full", "auto")
    assert convert.checkpoint_to_pb(_checkpoint(CheckpointKind.FS)).kind == "fs"
    failure = CheckpointFailure("sb", 3, CheckpointKind.FULL, 1.0, "CRIU failed", "/log")
    assert convert.failure_to_pb(failure) == pb.CheckpointFailure(
        sandbox_id="sb", turn=3, kind="full", at=1.0, error="CRIU failed", log_path="/log"
    )
    back = convert.spec_from_pb(pb.CreateSandboxRequest(env="busybox", checkpoints="full", recovery="auto"))
    assert back.checkpoints is CheckpointPolicy.FULL and back.recovery is RecoveryMode.AUTO
    default = convert.spec_from_pb(pb.CreateSandboxRequest(env="busybox"))
    assert default.checkpoints is CheckpointPolicy.AUTO and default.recovery is RecoveryMode.MANUAL


def test_where_a_restore_took_its_state_from_crosses_the_wire() -> None:
    spec = SandboxSpec(env="busybox")
    rec = SandboxRecord("sb", "sb", 0, spec, "img", "c", SandboxState.RUNNING, 1.0)
    assert SandboxInfo.from_pb(convert.sandbox_to_pb(rec)).files_from is None  # not a restore's answer
    rec.files_from, rec.images_from = FilesSource.SNAPSHOT, "hot"
    info = SandboxInfo.from_pb(convert.sandbox_to_pb(rec))
    assert (info.files_from, info.images_from) == (FilesSource.SNAPSHOT, "hot")
    rec.files_from, rec.images_from = FilesSource.BLOBS, None
    info = SandboxInfo.from_pb(convert.sandbox_to_pb(rec))
    assert (info.files_from, info.images_from) == (FilesSource.BLOBS, None)


# --- bad words stop at the edge, before anything changes ---------------------------------------


@pytest.mark.parametrize(
    ("field", "word", "message"),
    [
        ("checkpoints", "sometimes", "unknown checkpoint policy 'sometimes'"),
        ("recovery", "never", "unknown recovery policy 'never'"),
    ],
)
def test_the_api_edge_rejects_an_unknown_policy(field: str, word: str, message: str) -> None:
    req = pb.CreateSandboxRequest(env="busybox")
    setattr(req, field, word)
    with pytest.raises(InvalidRequest, match=message):
        convert.spec_from_pb(req)


def test_the_service_rejects_an_unknown_checkpoint_kind_before_looking_anything_up() -> None:
    touched: list[str] = []

    def lookup(_caller: Caller, ref: str) -> SandboxRecord:
        touched.append(ref)
        raise AssertionError("looked up")

    svc = Service.__new__(Service)
    svc._lookup = lookup  # type: ignore[method-assign,assignment]
    with pytest.raises(InvalidRequest, match="unknown checkpoint kind 'both'; use one of fs, full"):
        asyncio.run(svc.create_checkpoint(ROOT, "sb", "label", "both"))
    assert touched == []


def test_the_cli_offers_the_choices_and_rejects_others_without_calling_crabd(monkeypatch: pytest.MonkeyPatch) -> None:
    from crabd.cli import sandboxes
    from crabd.cli.common import app

    def no_client() -> None:
        raise AssertionError("crabd was called")

    monkeypatch.setattr(sandboxes, "client", no_client)
    runner = CliRunner()
    bad = runner.invoke(app, ["create", "busybox", "--checkpoints", "sometimes"])
    assert bad.exit_code == 2 and "sometimes" in bad.output
    bad = runner.invoke(app, ["create", "busybox", "--recovery", "never"])
    assert bad.exit_code == 2 and "never" in bad.output


def test_config_rejects_an_unknown_inspector_mode(tmp_path: Path) -> None:
    from crabd.config import load_config

    conf = tmp_path / "crab.toml"
    conf.write_text('[inspector]\nmode = "scan"\n')
    assert load_config(conf).inspector.mode is InspectorMode.SCAN
    conf.write_text('[inspector]\nmode = "sometimes"\n')
    with pytest.raises(ConfigError, match="inspector"):
        load_config(conf)


# --- named results instead of tuples and dicts -----------------------------------------------


def test_catalog_failures_are_records(db: Database) -> None:
    cat = Catalog(db)
    cat.record_failure("sb", 3, CheckpointKind.FULL, "CRIU could not dump", "/var/log/dump.log")
    [f] = cat.failures("sb")
    assert isinstance(f, CheckpointFailure)
    assert (f.sandbox_id, f.turn, f.kind, f.error, f.log_path) == (
        "sb",
        3,
        CheckpointKind.FULL,
        "CRIU could not dump",
        "/var/log/dump.log",
    )
    assert f.at > 0 and cat.failures("other") == []


def test_service_status_is_a_record_that_fills_the_reply() -> None:
    svc = Service.__new__(Service)
    svc.cfg = SimpleNamespace(paths=SimpleNamespace(state_dir=Path("/var/lib/crab"), socket=Path("/run/crab.sock")))  # type: ignore[assignment]
    place = ShardPlace(0, ("/run/crab.sock", "/run/crab-1.sock"))
    svc.sandboxes = SimpleNamespace(count_sandboxes=lambda _uid: 2, place=place)  # type: ignore[assignment]
    svc.inspection = SimpleNamespace(name="scan", why="probes compiling", pending=True)  # type: ignore[assignment]
    svc.started_at, svc.docker_version, svc.proxy_url = 5.0, "27.0", ""
    svc.process_restarts = lambda: 3
    svc.remote = RemoteCheckpoints(SimpleNamespace())  # type: ignore[arg-type]
    st = svc.status(ROOT)
    assert isinstance(st, DaemonStatus)
    assert (st.sandboxes, st.caller_uid, st.inspector, st.state_dir) == (2, 0, "scan", "/var/lib/crab")
    reply = pb.DaemonStatusResponse(**dataclasses.asdict(st))
    assert reply.sandboxes == 2 and reply.socket == "/run/crab.sock"
    assert (reply.inspector_why, reply.inspector_pending) == ("probes compiling", True)
    assert (reply.processes, reply.process_restarts) == (2, 3)


def test_engine_status_and_checkpoint_detail_are_records() -> None:
    svc = Service.__new__(Service)
    svc.engine = SimpleNamespace(  # type: ignore[assignment]
        clock=lambda: 1.0, jobs=lambda _uid: [], snapshot=lambda: {"queued": 0}, prometheus=lambda: "# crab\n"
    )
    svc.remote = RemoteCheckpoints(SimpleNamespace())  # type: ignore[arg-type]
    reads_kept = VouchedProcesses(lambda _sid: None, lambda _cid: [])
    reads_kept.walked, reads_kept.vouched = 3, 5
    svc.inspection = SimpleNamespace(  # type: ignore[assignment]
        process_reads=reads_kept.snapshot, prometheus=reads_kept.prometheus
    )
    counts = CaptureCounts(captured=2, reused=7, stepped_aside=4)
    svc.sandboxes = SimpleNamespace(capture_counts=counts)  # type: ignore[assignment]
    report = svc.engine_status(ROOT)
    reads = {"read": 3, "vouched": 5}
    captures = {"captured": 2, "reused": 7}
    assert report == EngineReport(
        counters={
            "queued": 0,
            "inspector_process_reads": reads,
            "session_captures": captures,
            "session_steps_aside": 4,
        },
        jobs=[],
        prometheus="# crab\n"
        "# HELP crab_inspector_process_reads_total Turn ends by how the sandbox's processes were known.\n"
        "# TYPE crab_inspector_process_reads_total counter\n"
        'crab_inspector_process_reads_total{how="read"} 3\n'
        'crab_inspector_process_reads_total{how="vouched"} 5\n'
        "# HELP crab_session_captures_total Session states stored, by how they were known.\n"
        "# TYPE crab_session_captures_total counter\n"
        'crab_session_captures_total{how="captured"} 2\n'
        'crab_session_captures_total{how="reused"} 7\n',
    )

    rec = _checkpoint(CheckpointKind.FS)

    async def describe(_rec: object, _limit: int) -> Contents:
        return Contents([], False, '{"cwd": "/"}')

    svc.catalog = SimpleNamespace(find=lambda _id: rec, lineage=lambda _id: [rec])  # type: ignore[assignment]
    svc.housekeeping = SimpleNamespace(describe=describe)  # type: ignore[assignment]

    async def as_kept(recs: list[object]) -> list[object]:
        return recs

    svc.retention = SimpleNamespace(annotate=as_kept)  # type: ignore[assignment]
    detail = asyncio.run(svc.describe_checkpoint(ROOT, "ck-1"))
    assert detail == CheckpointDetail(rec, [], False, '{"cwd": "/"}', ["ck-1"])
    assert convert.detail_to_pb(detail).lineage == ["ck-1"]


def test_sqlite_rows_written_by_hand_read_back_as_members(db: Database) -> None:
    # What an older crabd wrote (the same strings) reads back as members.
    with db.tx() as conn:
        conn.execute(
            "INSERT INTO failures(sandbox_id, turn, kind, at, error, log_path) VALUES('sb', 1, 'full', 1.0, 'x', '')"
        )
    assert [f.kind for f in Catalog(db).failures(None)] == [CheckpointKind.FULL]
