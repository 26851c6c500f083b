"""mini-swe-agent's own agent loop in crab sandboxes (crabd.integrations.minisweagent; docs/minisweagent.md).

The model is mini-swe-agent's DeterministicModel, scripted with a task's
oracle commands and then the submit command; the task's verifier judges.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

from agents import tasks
from crabd.errors import DaemonUnavailable, ImageError
from crabd.integrations.minisweagent import SUBMIT_MARKER, CrabEnvironment, CrabEnvironmentError
from crabd.sdk import Client, EmbeddedDaemon
from tests.conftest import REPO
from tests.integration.conftest import kill_container

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu, pytest.mark.slow]
PATH = "crabd.integrations.minisweagent.CrabEnvironment"
KV = tasks.find("shell/kv-server")  # its server, started at step 2, must stay alive for steps 3 and 4
#: mini-swe-agent's own default configuration (agent templates, environment variables, observation template).
DEFAULTS: dict[str, Any] = get_config_from_spec("default.yaml")


def oracle_outputs(task: tasks.Task, *, before: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Model answers: ``before``'s commands, the oracle's, then the submit command."""
    commands = [*before, *(t.run for t in task.turns)]
    answers = [make_output(f"Step {i}.", [{"command": c}]) for i, c in enumerate(commands, 1)]
    return [*answers, make_output("Done.", [{"command": f"echo {SUBMIT_MARKER}"}])]


def deterministic(outputs: list[dict[str, Any]]) -> DeterministicModel:
    template = DEFAULTS["model"]["observation_template"]
    return DeterministicModel(outputs=outputs, observation_template=template)  # type: ignore[no-untyped-call]


def agent(model: Any, env: CrabEnvironment) -> DefaultAgent:
    return DefaultAgent(model, env, **DEFAULTS["agent"])


def crab_env(daemon: EmbeddedDaemon, **kw: Any) -> CrabEnvironment:
    config = {"environment_class": PATH, "socket": str(daemon.socket), "timeout": 120, **DEFAULTS["environment"], **kw}
    env = get_environment(config)
    assert isinstance(env, CrabEnvironment)
    return env


@pytest.fixture
def no_leaks(daemon: EmbeddedDaemon) -> Iterator[None]:
    """The test leaves no sandbox behind in crabd."""
    with Client(daemon.socket) as c:
        before = {s.id for s in c.list()}
        yield
        left = {s.name for s in c.list() if s.id not in before}
    assert not left, f"sandboxes left behind: {left}"


def observations(agent: DefaultAgent) -> list[str]:
    """What the model was shown after each command: its return code lines."""
    return [m["content"] for m in agent.messages if m["role"] == "user"][1:]


def test_the_oracle_solves_a_task_through_mini_swe_agents_own_loop(daemon: EmbeddedDaemon, no_leaks: None) -> None:
    env = crab_env(daemon, crab_task=KV.name)
    try:
        a = agent(deterministic(oracle_outputs(KV)), env)
        info = a.run(KV.spec.instruction)
        assert info["exit_status"] == "Submitted", a.messages[-1]
        assert all("<returncode>0</returncode>" in o for o in observations(a)), observations(a)
        verdict = env.verify()
        assert verdict.passed, verdict.output
        steps = env.steps
        assert [s.command for s in steps] == [*(t.run for t in KV.turns), f"echo {SUBMIT_MARKER}"]
        assert [s.turn for s in steps] == sorted({s.turn for s in steps})  # one turn each, in order
        assert all(env.checkpoint_of(s.step) for s in steps)  # policy auto: every step's state is restorable
        traj = a.serialize()
        assert traj["info"]["config"]["environment_type"] == PATH
        assert [s["turn"] for s in traj["info"]["crab"]["steps"]] == [s.turn for s in steps]
        assert traj["info"]["crab"]["recoveries"] == []
    finally:
        env.cleanup()


class KillingModel(DeterministicModel):
    """Kills the sandbox's container at chosen moments of the run, from the model's side."""

    def __init__(self, env: CrabEnvironment, kills: dict[int, str], **kw: Any) -> None:
        super().__init__(**kw)  # type: ignore[no-untyped-call]
        self.env = env
        #: query index -> "settled" (after the last step's checkpoint is durable) or "at once".
        self.kills = kills

    def query(self, messages: list[dict[str, str]], **kwargs: Any) -> dict[str, Any]:
        how = self.kills.pop(self.current_index + 1, None)
        if how == "settled":
            self.env.checkpoint_of(len(self.env.steps))
        if how is not None:
            kill_container(self.env.sandbox.refresh().container_id)
        out: dict[str, Any] = super().query(messages, **kwargs)
        return out


def test_a_run_whose_container_is_killed_goes_on_through_crabs_recovery(daemon: EmbeddedDaemon, no_leaks: None) -> None:
    env = crab_env(daemon, crab_task=KV.name)
    try:
        # Killed three times: in the middle of the slow first command (it is re-run); while the model
        # "thinks" after step 3 started the server, once that step's checkpoint is durable (the server
        # comes back with it); and at once after step 4 loaded the records (its checkpoint is usually
        # still being taken and is lost: step 4 is re-run before step 5).
        slow = "sleep 6 && echo slept"
        model = KillingModel(
            env,
            {3: "settled", 4: "at once"},
            outputs=oracle_outputs(KV, before=(slow,)),
            observation_template=DEFAULTS["model"]["observation_template"],
        )
        killer = threading.Timer(2.0, lambda: kill_container(env.sandbox.refresh().container_id))
        killer.start()
        a = agent(model, env)
        info = a.run(KV.spec.instruction)
        killer.join()
        assert info["exit_status"] == "Submitted", a.messages[-1]
        seen = observations(a)
        assert all("<returncode>0</returncode>" in o for o in seen), seen
        assert "slept" in seen[0] and len(seen) == len(KV.turns) + 1
        verdict = env.verify()
        assert verdict.passed, verdict.output
        assert len(env.recoveries) == 3, env.recoveries
        assert [s.returncode for s in env.steps] == [0] * (len(KV.turns) + 2)
        assert env.serialize()["info"]["crab"]["recoveries"] == [r.to_json() for r in env.recoveries]
    finally:
        env.cleanup()


def test_rollback_restores_files_and_session_and_forks_are_independent(daemon: EmbeddedDaemon, no_leaks: None) -> None:
    with CrabEnvironment(socket=str(daemon.socket), image="bookworm", timeout=60, env={"PAGER": "cat"}) as env:

        def run(command: str, e: CrabEnvironment = env) -> str:
            out = e.execute({"command": command})
            assert out["returncode"] == 0, out
            return str(out["output"])

        run("mkdir -p /w && cd /w && export MARK=one && echo one > f")
        run("cd /tmp && export MARK=two && echo two > /w/f && touch /w/g")
        assert run('echo "$PWD $MARK"; cat /w/f') == "/tmp two\ntwo\n"
        env.rollback(1)
        assert len(env.steps) == 1
        assert run('echo "$PWD $MARK"; cat /w/f; ls /w') == "/w one\none\nf\n"
        a, b = env.fork(2, step=1)
        try:
            run("echo mine > f", a)
            assert run('echo "$PWD $MARK"; cat /w/f', b) == "/w one\none\n"
            assert run("cat /w/f", a) == "mine\n"
            a.rollback(1)  # a step its parent ran: restored by its checkpoint
            assert run('echo "$PWD $MARK"; cat /w/f', a) == "/w one\none\n"
        finally:
            a.cleanup()
            b.cleanup()
        assert env.checkpoint_of(1) and env.checkpoint_of(0)
        # A timeout is an observation, as in mini-swe-agent's docker environment; the next command runs in a
        # new bash with the directory and variables of the last turn end.
        out = env.execute({"command": "cd / && echo started && sleep 30"}, timeout=2)
        assert out["returncode"] == -1 and out["extra"]["exception_type"] == "TimeoutExpired", out
        assert "timed out after 2 seconds" in out["exception_info"] and out["output"] == "started\n"
        assert run('echo "$PWD $MARK $PAGER"') == "/w one cat\n"


def test_crabd_unreachable_or_a_refused_sandbox_is_an_environment_error_and_leaks_nothing(
    daemon: EmbeddedDaemon, no_leaks: None
) -> None:
    with pytest.raises(CrabEnvironmentError, match="crabd is unreachable") as raised:
        get_environment({"environment_class": PATH, "socket": "/nonexistent/crabd.sock"})
    assert isinstance(raised.value.crab_error, DaemonUnavailable)
    with pytest.raises(CrabEnvironmentError, match="no-such-env") as refused:
        crab_env(daemon, image="no-such-env")
    assert isinstance(refused.value.crab_error, ImageError), refused.value.__cause__


def test_the_mini_cli_selects_it_by_import_path_and_removes_its_sandbox_at_exit(
    daemon: EmbeddedDaemon, no_leaks: None, tmp_path: Path
) -> None:
    outputs = [
        make_output("look", [{"command": "cd /tmp && export MARK=kept && pwd"}]),
        make_output("check", [{"command": 'echo "$PWD $MARK"'}]),
        make_output("done", [{"command": f"echo {SUBMIT_MARKER}"}]),
    ]
    traj = tmp_path / "run.traj.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MSWEA_CONFIGURED": "1",
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mswea"),
    }
    mini = [sys.executable, "-m", "minisweagent.run.mini"]
    args = [
        *("--environment-class", PATH),
        *("--model-class", "minisweagent.models.test_models.DeterministicModel", "-m", "deterministic"),
        *("-c", "mini.yaml", "-c", f"model.outputs={json.dumps(outputs)}"),
        *("-c", f"environment.socket={daemon.socket}", "-c", "environment.sandbox_name=mini-cli"),
        *("-t", "say where you are", "-y", "--exit-immediately", "-o", str(traj)),
    ]
    done = subprocess.run([*mini, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(traj.read_text())
    assert data["info"]["exit_status"] == "Submitted"
    assert data["info"]["config"]["environment_type"] == PATH
    assert data["info"]["crab"]["sandbox_name"] == "mini-cli" and len(data["info"]["crab"]["steps"]) == 3
    shown = [m for m in data["messages"] if m["role"] in ("user", "tool")]
    assert any("/tmp kept" in str(m["content"]) for m in shown), shown  # the session persisted
