"""Checkpoint work below the sandboxes' CPU priority, on the real host: a sandbox spinning on every core.

A job no agent waits on runs its helpers (runc, CRIU) at SCHED_IDLE, so beside
a sandbox at 100% CPU it hardly runs; the agent's next action promotes it and
it must then finish.  Removing the sandbox while such a job runs ends the job
cleanly and leaves nothing behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from crabd.sdk import Client, EmbeddedDaemon, EngineJob, Sandbox
from tests.integration.conftest import instance_containers, instance_snapshots

pytestmark = [pytest.mark.criu]

#: One spinning loop per core of the host, until the sandbox is removed.
BURN = "for i in $(seq $(nproc)); do (while :; do :; done) & done"


@pytest.fixture
def burner(make_sandbox: Callable[..., Sandbox]) -> Iterator[Sandbox]:
    sb = make_sandbox("bookworm", checkpoints="none")
    sb.session.run(BURN)
    yield sb


def jobs_of(client: Client, sb: Sandbox) -> list[EngineJob]:
    return [j for j in client.engine_status().jobs if j.sandbox_id == sb.id]


def running_demoted(client: Client, sb: Sandbox, deadline_s: float = 30.0) -> EngineJob | None:
    """A turn end whose full checkpoint is seen running at background priority (None: each ran too fast)."""
    for attempt in range(5):
        sb.begin_turn()
        sb.session.run(f"sleep 100{attempt} &")  # a new process: the turn needs a full checkpoint
        sb.end_turn()  # returns at once; the job is queued at normal priority
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            job = jobs_of(client, sb)[-1]
            if job.state in ("dumping", "versioning") and job.demoted_s > 0.05:
                return job
            if job.state in ("done", "failed"):
                break
            time.sleep(0.02)
    return None


def test_an_agents_wait_promotes_a_starved_job_and_it_finishes(
    client: Client, make_sandbox: Callable[..., Sandbox], burner: Sandbox
) -> None:
    sb = make_sandbox("bookworm")
    job = running_demoted(client, sb)
    assert job is not None, "no checkpoint job was ever seen running at background priority"
    # The agent acts again: it waits on the job, which is promoted while it runs, and finishes.
    sb.session.run("true")
    [done] = [j for j in jobs_of(client, sb) if j.id == job.id]
    assert done.state == "done", done
    assert done.priority == "urgent" and done.demoted_s > 0 and done.promoted_s > 0, done
    assert done.exposed_s > 0  # the agent waited for it
    stats = client.engine_status().stats
    assert stats["promotions_running"] >= 1 and stats["demoted_s"] > 0


def test_removing_a_sandbox_while_its_job_runs_demoted_ends_the_job_and_leaves_nothing(
    daemon: EmbeddedDaemon, client: Client, make_sandbox: Callable[..., Sandbox], burner: Sandbox
) -> None:
    sb = make_sandbox("bookworm")
    job = running_demoted(client, sb)
    assert job is not None, "no checkpoint job was ever seen running at background priority"
    checkpoints = {c.id for c in sb.checkpoints()}
    container = sb.info.container_id
    sb.remove(force=True)  # waits for the job (promoting it), then removes everything
    [ended] = [j for j in jobs_of(client, sb) if j.id == job.id]
    assert ended.state in ("done", "failed") and ended.promoted_s > 0, ended
    assert sb.id not in {s.id for s in client.list()}
    assert container not in instance_containers(daemon.state_dir)
    assert not checkpoints & instance_snapshots(daemon.state_dir)
    dumps = daemon.state_dir / "run" / "dumps"
    assert not dumps.exists() or not any(dumps.iterdir())  # no half-written dump left
    assert client.verify().ok
