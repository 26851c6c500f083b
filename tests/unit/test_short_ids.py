"""Short ids: crabd takes a unique prefix of an id wherever a request names a sandbox or checkpoint,
among the caller's own only (crabd/service/refs.py), and crabctl prints such prefixes (crabd/cli/common.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.cli.common import short_ids
from crabd.coordinator import checkpoints as checkpoints_mod
from crabd.errors import AmbiguousReference, CheckpointNotFound, SandboxNotFound
from tests.fakes import ALICE, BOB, ROOT, build_stack, run, spec


def _ids(values: list[str], then: str) -> Iterator[str]:
    """``values``, then ``then`` with a counter."""
    yield from values
    n = 0
    while True:
        n += 1
        yield f"{then}{n:08x}"


def test_a_unique_prefix_names_a_sandbox_or_checkpoint_of_the_caller_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)
    svc = st.service
    sandbox_ids = _ids(["aaaa11110000", "aaaa22220000", "aaaa33330000"], "ffff")
    monkeypatch.setattr(st.sandboxes, "new_id", lambda: next(sandbox_ids))
    ck_ids = _ids([f"ck-bbbb{i}0000000" for i in range(1, 4)], "ck-ffff")
    monkeypatch.setattr(checkpoints_mod, "new_checkpoint_id", lambda: next(ck_ids))

    async def body() -> None:
        a1 = await svc.create(ALICE, spec("a1", checkpoints="fs"))
        await svc.create(ALICE, spec("a2", checkpoints="fs"))
        b1 = await svc.create(BOB, spec("b1", checkpoints="fs"))
        assert (a1.id, b1.id) == ("aaaa11110000", "aaaa33330000")
        # Unique among the caller's own: found, by every request that names a sandbox.
        assert (await svc.get(ALICE, "aaaa1")).id == a1.id
        assert (await svc.turns(ALICE, "aaaa1", 0)) is not None
        assert svc.authorize(ALICE, "aaaa1") == a1.id
        # Another uid's sandbox is no candidate: Bob's "aaaa" is his one sandbox, and Alice's prefix
        # is "no sandbox" to him, as if it did not exist (never PermissionDenied, which would reveal it).
        assert (await svc.get(BOB, "aaaa")).id == b1.id
        with pytest.raises(SandboxNotFound):
            await svc.get(BOB, "aaaa1")
        # Ambiguous: the error lists the caller's candidates, with their names, and nobody else's.
        with pytest.raises(AmbiguousReference) as amb:
            await svc.get(ALICE, "aaaa")
        assert amb.value.candidates == ["aaaa11110000", "aaaa22220000"]
        assert "aaaa11110000 (a1)" in amb.value.message and b1.id not in amb.value.message
        assert amb.value.hint and "crabctl ps" in amb.value.hint
        with pytest.raises(AmbiguousReference) as amb:
            await svc.get(ROOT, "aaaa")
        assert len(amb.value.candidates) == 3
        # Too short to be taken for an id: a name that does not exist.
        with pytest.raises(SandboxNotFound):
            await svc.get(ALICE, "aaa")
        # A name still wins over a prefix.
        assert (await svc.get(ALICE, "a2")).name == "a2"

        # Checkpoints: "ck-" and a prefix, among the caller's own.
        a1_ck = st.checkpointer.head_id(a1.id)
        b1_ck = st.checkpointer.head_id(b1.id)
        assert a1_ck == "ck-bbbb10000000" and b1_ck == "ck-bbbb30000000"
        assert (await svc.describe_checkpoint(ALICE, "ck-bbbb1")).checkpoint.id == a1_ck
        with pytest.raises(CheckpointNotFound):
            await svc.describe_checkpoint(BOB, "ck-bbbb1")
        assert (await svc.describe_checkpoint(BOB, "ck-bbbb")).checkpoint.id == b1_ck
        with pytest.raises(AmbiguousReference) as amb:
            await svc.describe_checkpoint(ALICE, "ck-bbbb")
        assert amb.value.candidates == ["ck-bbbb10000000", "ck-bbbb20000000"]
        forked = await svc.fork(ALICE, "ck-bbbb1", "", 1, "kid")
        assert forked[0] == a1_ck

    run(body())


def test_tables_print_the_shortest_prefix_that_keeps_ids_apart() -> None:
    short = short_ids(["aaaa11110000", "aaaa22220000"])
    assert short("aaaa11110000") == "aaaa1111"
    # Two ids alike in their first 8 digits: both get as many as tell them apart.
    alike = short_ids(["ck-0123456789ab", "ck-01234567ffff"])
    assert alike("ck-0123456789ab") == "ck-012345678"
    assert alike("") == ""
    assert short_ids(["ck-0123456789ab"], no_trunc=True)("ck-0123456789ab") == "ck-0123456789ab"


def test_a_described_checkpoint_says_why_it_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`crabctl checkpoint inspect` shows what `checkpoint ls` and `pin` show, not "None"."""
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        head = st.checkpointer.head_id(rec.id)
        assert head is not None
        kept = (await st.service.describe_checkpoint(ALICE, head)).checkpoint.kept_for
        listed = [c.kept_for for c in await st.service.list_checkpoints(ALICE, "a") if c.id == head]
        assert kept and [kept] == listed

    run(body())
