"""The service layer's rules on fake backends: who may see and act on what, and bad input changes nothing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from crabd.errors import CrabError, InvalidRequest, PermissionDenied, SandboxNotFound
from crabd.models import SandboxSpec
from tests.fakes import ALICE, BOB, ROOT, Stack, build_stack, run, spec


def _world(st: Stack) -> tuple[Any, ...]:
    """Everything a refused request must leave as it was."""
    sandboxes = sorted(
        (r.id, r.name, r.owner_uid, r.state, r.container_id, r.branch, r.turn) for r in st.registry.list_sandboxes()
    )
    checkpoints = sorted((c.id, c.sandbox_id) for c in st.catalog.list_checkpoints())
    heads = sorted((r.id, st.checkpointer.head_id(r.id)) for r in st.registry.list_sandboxes())
    return sandboxes, checkpoints, heads, sorted(st.backend.containers), st.blob_files()


async def _refused(st: Stack, error: type[CrabError], call: Callable[[], Awaitable[object]]) -> CrabError:
    before = _world(st)
    with pytest.raises(error) as info:
        await call()
    assert _world(st) == before, "a refused request changed something"
    return info.value


def test_another_uid_cannot_act_on_a_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)
    svc = st.service

    async def body() -> None:
        rec = await svc.create(ALICE, spec("alices", checkpoints="fs"))
        ckpt = st.checkpointer.head_id(rec.id)
        assert ckpt is not None
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: svc.get(BOB, "alices"),
            lambda: svc.get(BOB, rec.id),
            lambda: svc.stop(BOB, "alices", 1.0),
            lambda: svc.remove(BOB, "alices", True),
            lambda: svc.command_edge.exec(
                BOB,
                "alices",
                ["true"],
                env={},
                workdir="",
                stdin=b"",
                timeout_s=1,
                max_output=0,
                user="",
                sink=None,
            ),
            lambda: svc.command_edge.session_run(BOB, "alices", "true", timeout_s=1, max_output=0, sink=None),
            lambda: svc.begin_turn(BOB, "alices"),
            lambda: svc.end_turn(BOB, "alices"),
            lambda: svc.turns(BOB, "alices", 0),
            lambda: svc.create_checkpoint(BOB, "alices", "", "fs"),
            lambda: svc.list_checkpoints(BOB, "alices"),
            lambda: svc.restore(BOB, "alices", ckpt, -1),
            lambda: svc.fork(BOB, "", "alices", 1, ""),
            lambda: svc.fork(BOB, ckpt, "", 1, ""),
            lambda: svc.describe_checkpoint(BOB, ckpt),
            lambda: svc.delete_checkpoint(BOB, ckpt),
            lambda: svc.tree(BOB, "alices", ""),
            lambda: svc.tree(BOB, "", ckpt),
            lambda: svc.failures(BOB, "alices"),
            lambda: svc.recover(BOB, "alices"),
        ]
        for call in calls:
            err = await _refused(st, PermissionDenied, call)
            assert err.attrs["uid"] == BOB.uid
        # Root may; the owner may.
        assert (await svc.get(ROOT, "alices")).id == rec.id
        assert (await svc.get(ALICE, "alices")).id == rec.id

    run(body())


def test_listings_show_only_the_callers_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)
    svc = st.service

    async def body() -> None:
        a = await svc.create(ALICE, spec("a1", checkpoints="fs"))
        b = await svc.create(BOB, spec("b1", checkpoints="fs"))
        st.faults.arm("fs.capture")
        for caller, name in ((ALICE, "a1"), (BOB, "b1")):
            with pytest.raises(CrabError):
                await svc.create_checkpoint(caller, name, "", "fs")
        assert [r.id for r in await svc.list_sandboxes(ALICE)] == [a.id]
        assert [r.id for r in await svc.list_sandboxes(BOB)] == [b.id]
        assert {r.id for r in await svc.list_sandboxes(ROOT)} == {a.id, b.id}
        assert {c.sandbox_id for c in await svc.list_checkpoints(BOB, "")} == {b.id}
        assert {c.sandbox_id for c in await svc.list_checkpoints(ROOT, "")} == {a.id, b.id}
        assert {f.sandbox_id for f in await svc.failures(ALICE, "")} == {a.id}
        assert {f.sandbox_id for f in await svc.failures(ROOT, "")} == {a.id, b.id}
        assert svc.status(BOB).sandboxes == 1
        assert svc.status(ROOT).sandboxes == 2
        view = await svc.tree(BOB, "b1", "")
        assert a.id not in repr(view)

    run(body())


def test_root_only_operations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        await st.service.create(ALICE, spec("a", checkpoints="fs"))
        await _refused(st, PermissionDenied, lambda: st.service.gc(ALICE))
        await _refused(st, PermissionDenied, lambda: st.service.quota(ALICE, BOB.uid))
        assert (await st.service.quota(ALICE, -1)).uid == ALICE.uid
        assert (await st.service.quota(ROOT, ALICE.uid)).uid == ALICE.uid

    run(body())


@pytest.mark.parametrize(
    "bad",
    [
        SandboxSpec(env=""),
        # Unknown policy words never reach the service: the gRPC edge parses them (tests/unit/test_vocabulary.py).
        SandboxSpec(env="bookworm", name="no spaces"),
        SandboxSpec(env="bookworm", memory_bytes=1024),
        SandboxSpec(env="bookworm", pids=-1),
        SandboxSpec(env="bookworm", workdir="relative"),
        SandboxSpec(env="bookworm", env_vars={"A=B": "x"}),
        SandboxSpec(env="no-such-env"),
    ],
)
def test_bad_create_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: SandboxSpec) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        await _refused(st, CrabError, lambda: st.service.create(ALICE, bad))
        assert st.registry.list_sandboxes() == []
        assert st.faults.calls.get("backend.create", 0) == 0

    run(body())


def test_a_taken_name_is_refused_before_any_container(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        await st.service.create(ALICE, spec("same", checkpoints="fs"))
        created = st.faults.calls["backend.create"]
        err = await _refused(st, CrabError, lambda: st.service.create(BOB, spec("same")))
        assert "already exists" in err.message
        assert st.faults.calls["backend.create"] == created

    run(body())


def test_an_unnamed_sandbox_whose_short_name_is_taken_gets_its_whole_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)
    ids = iter(["abcdef000001", "abcdef000002", "abcdef000003"])
    monkeypatch.setattr(st.service.sandboxes, "new_id", lambda: next(ids))

    async def body() -> None:
        first = await st.service.create(ALICE, spec("", checkpoints="fs"))
        # Same first six digits: the short name is taken, so the whole id names it (not AlreadyExists).
        second = await st.service.create(BOB, spec("", checkpoints="fs"))
        assert (first.name, second.name) == ("sb-abcdef", "sb-abcdef000002")
        # A name a user gave is still refused when taken.
        err = await _refused(st, CrabError, lambda: st.service.create(BOB, spec("sb-abcdef")))
        assert "already exists" in err.message

    run(body())


def test_bad_requests_on_a_sandbox_change_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)
    svc = st.service

    async def body() -> None:
        a = await svc.create(ALICE, spec("a", checkpoints="fs"))
        other = await svc.create(ALICE, spec("other", checkpoints="fs"))
        foreign = st.checkpointer.head_id(other.id)
        assert foreign is not None

        def exec_(argv: list[str], **kw: Any) -> Callable[[], Awaitable[object]]:
            args: dict[str, Any] = (
                dict(env={}, workdir="", stdin=b"", timeout_s=1, max_output=0, user="", sink=None) | kw
            )
            return lambda: svc.command_edge.exec(ALICE, "a", argv, **args)

        invalid: list[Callable[[], Awaitable[object]]] = [
            exec_([]),
            exec_(["a\0b"]),
            exec_(["ls"], workdir="tmp"),
            exec_(["ls"], user="root"),
            exec_(["ls"], max_output=-1),
            lambda: svc.command_edge.session_run(ALICE, "a", "  ", timeout_s=1, max_output=0, sink=None),
            lambda: svc.create_checkpoint(ALICE, "a", "", "everything"),
            lambda: svc.create_checkpoint(ALICE, "a", "x" * 201, "fs"),
            lambda: svc.restore(ALICE, "a", "", -1),
            lambda: svc.restore(ALICE, "a", "", -2),
            # Another sandbox's checkpoint is not in this one's history, even with the same owner.
            lambda: svc.restore(ALICE, "a", foreign, -1),
            lambda: svc.fork(ALICE, foreign, "a", 1, ""),
            lambda: svc.fork(ALICE, "", "", 1, ""),
            lambda: svc.fork(ALICE, foreign, "", 0, ""),
            lambda: svc.fork(ALICE, foreign, "", 65, ""),
            lambda: svc.fork(ALICE, foreign, "", 1, "bad prefix!"),
            lambda: svc.fork(ALICE, foreign, "", 1, "", turn=1),
            lambda: svc.end_turn(ALICE, "a"),
            lambda: svc.recover(ALICE, "a"),
            lambda: svc.get(ALICE, ""),
        ]
        for call in invalid:
            await _refused(st, InvalidRequest, call)
        await _refused(st, SandboxNotFound, lambda: svc.get(ALICE, "nobody"))
        # A refused checkpoint request is not a checkpoint failure.
        assert st.catalog.failures(a.id) == []

    run(body())
