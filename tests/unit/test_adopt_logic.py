"""What crabd finds after a restart (``SandboxManager.adopt``), on fake backends: each case counted once."""

from __future__ import annotations

from pathlib import Path

import pytest

from crabd.coordinator.sandboxes import Adopted
from crabd.models import SandboxState
from tests.fakes import ALICE, build_stack, run, spec


def test_adopt_counts_and_settles_every_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        live = await st.service.create(ALICE, spec("live", checkpoints="none"))
        gone = await st.service.create(ALICE, spec("gone", checkpoints="none"))
        dead = st.registry.get_sandbox(gone.id)
        assert dead is not None
        st.backend.kill(dead.container_id)
        # A container no row points at (a crash between create and the row's update).
        orphan = st.backend.create("sb-stray", spec("stray"), "img", tmp_path / "init", {})
        # A creation a crash interrupted: a row still CREATING.
        half = await st.sandboxes.reserve(ALICE.uid, spec("half"), "img")
        st.backend.frozen_now.add(live.container_id)  # a crabd killed mid-checkpoint left it frozen

        got = await st.sandboxes.adopt()

        assert got == Adopted(adopted=1, dead=1, rolled_back=1, orphans_removed=1, removed=0)
        assert orphan not in st.backend.containers
        assert st.registry.get_sandbox(half.id) is None
        assert live.container_id not in st.backend.frozen_now
        after = st.registry.get_sandbox(gone.id)
        assert after is not None and after.state is SandboxState.DEAD
        again = await st.sandboxes.adopt()  # a second pass finds nothing left to fix
        assert again == Adopted(adopted=1)  # the dead one was recorded the first time

    run(body())
