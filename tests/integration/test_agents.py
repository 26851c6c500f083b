"""The task suites, the agents and the end-to-end harness, on real sandboxes (issue 8)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agents import tasks
from agents.harness.__main__ import main as harness_main
from agents.llm import ChatClient
from agents.shell_agent import ShellAgent
from agents.trace_agent import TraceAgent
from crabd.llm.latency import ScriptedToolCall, ScriptEntry
from crabd.llm.standin import StandinServer
from crabd.sdk import Client, EmbeddedDaemon

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu, pytest.mark.slow]


def test_suites_are_big_enough() -> None:
    assert len(tasks.load_suite("shell")) >= 20
    assert len(tasks.load_suite("repair")) >= 15
    assert len(tasks.load_suite("mixed")) >= 8


def test_every_oracle_solves_its_task_and_no_verifier_passes_unsolved(client: Client) -> None:
    # For each task: the verifier fails on the fresh environment, every oracle turn exits 0,
    # and the verifier then passes.
    every = [t for s in tasks.SUITES for t in tasks.load_suite(s)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda t: tasks.check_oracle(client, t), every))
    bad = [f"{r.task}: {r.problem[:300]}" for r in results if not r.ok]
    assert not bad, "\n".join(bad)


def oracle_script(task: tasks.Task) -> list[ScriptEntry]:
    """A model that answers with the oracle's turns as bash tool calls, then says it is done."""
    steps = [
        ScriptEntry(
            content=t.think or "next", tool_calls=(ScriptedToolCall(name="bash", arguments={"command": t.run}),)
        )
        for t in task.turns
    ]
    return [*steps, ScriptEntry(content="Done: the task is solved.")]


@pytest.fixture
def kv_task() -> tasks.Task:
    return tasks.find("shell/kv-server")


def test_shell_agent_solves_a_task_through_tool_calls(client: Client, kv_task: tasks.Task) -> None:
    with StandinServer(time_scale=0.05, script=oracle_script(kv_task)) as llm, tasks.create(client, kv_task) as sb:
        run = ShellAgent(ChatClient(f"{llm.url}/v1")).solve(sb, kv_task.spec.instruction)
        assert run.finished and run.actions == len(kv_task.turns)
        assert tasks.verify(sb, kv_task).passed
        # Each action was one crab turn; the tool outputs went back to the model.
        assert len([t for t in sb.turns() if not t.implicit]) >= len(kv_task.turns)
        assert any(m["role"] == "tool" and m["content"].startswith("exit code 0") for m in run.messages)


@pytest.fixture
def proxied_llm(kv_task: tasks.Task) -> Iterator[tuple[Client, StandinServer]]:
    with StandinServer(time_scale=0.05, script=oracle_script(kv_task)) as llm:
        d = EmbeddedDaemon(extra_args=["--proxy-upstream", llm.url, "--proxy-listen", "127.0.0.1:0"])
        d.start()
        try:
            with Client(d.socket) as c:
                yield c, llm
        finally:
            d.close()


def test_shell_agent_through_crabs_proxy_needs_no_turn_calls(
    proxied_llm: tuple[Client, StandinServer], kv_task: tasks.Task
) -> None:
    client, llm = proxied_llm
    with tasks.create(client, kv_task) as sb:
        agent = ShellAgent(ChatClient(f"{llm.url}/v1"), proxy=True)
        run = agent.solve(sb, kv_task.spec.instruction)
        assert run.finished and tasks.verify(sb, kv_task).passed
        # Every request through the proxy ended a turn; the server ran from turn 1 on, so those
        # turn ends took process checkpoints, and restoring the last one brings the server back.
        ended = [t for t in sb.turns() if t.checkpoint_state in ("done", "skipped")]
        assert len(ended) >= len(kv_task.turns)
        sb.restore(sb.checkpoints()[-1])
        assert tasks.verify(sb, kv_task).passed


def test_trace_agent_replays_a_task(client: Client, kv_task: tasks.Task) -> None:
    with StandinServer(time_scale=0.05) as llm, tasks.create(client, kv_task) as sb:
        stats = TraceAgent(ChatClient(f"{llm.url}/v1")).run(sb, kv_task)
        assert [s.exit_code for s in stats] == [0] * len(kv_task.turns)
        assert all(s.llm_s > 0 and s.completion_tokens > 0 for s in stats)
        assert tasks.verify(sb, kv_task).passed


def test_harness_recovers_crab_from_every_fault_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "e2e"
    args = ["--suite", "shell", "--task", "kv-server", "--concurrency", "1", "--rounds", "1", "--time-scale", "0.3"]
    args += ["--strategies", "none,chat+fs,crab", "--faults", "sandbox-kill,crabd-kill,preempt", "--out", str(out)]
    assert harness_main(args) == 0
    doc = json.loads((out / "results.json").read_text())
    for e in doc["episodes"]:
        assert not e["error"], e
    ff = doc["fault_free"]
    assert ff["none"]["solved"] == ff["crab"]["solved"] == 1
    assert ff["crab"]["checkpoints"] > 0 and sum(ff["crab"]["decisions"].values()) == len(
        tasks.find("shell/kv-server").turns
    )
    for fault in ("sandbox-kill", "crabd-kill", "preempt"):
        crab = doc["faults"][fault]["crab"]
        assert crab["solved"] == 1, (fault, [e for e in doc["episodes"] if e["fault_arm"] == fault])
    # The kv server's data lives only in its memory: a files-only recovery loses it
    # whenever the fault came after the server was started (turn 1).
    for e in doc["episodes"]:
        if e["strategy"] == "chat+fs" and e["fault"] in ("sandbox-kill", "preempt") and e["fault_turn"] >= 2:
            assert not e["solved"], e
    assert doc["crabd_kills"]["crabd-kill/crab"] >= 1
    for f in ("results.md", "correctness.png", "traffic.png", "exposed_cdf.png"):
        assert (out / f).stat().st_size > 0
