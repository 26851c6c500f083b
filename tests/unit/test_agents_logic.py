"""Logic of the task loader, the LLM client, the harness's strategies and its report (no sandboxes)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agents import tasks
from agents.harness.episode import Result
from agents.harness.report import markdown, plots, summarize
from agents.harness.strategies import STRATEGIES, Episode, lost_turns
from agents.llm import ChatClient, LLMError
from crabd.llm.latency import ScriptedToolCall, ScriptEntry
from crabd.llm.standin import StandinServer


def write_task(root: Path, tid: str = "t1", **files: str) -> Path:
    d = root / "shell" / tid
    d.mkdir(parents=True)
    base = {
        "task.toml": 'instruction = "do it"\ndepends_on = ["processes"]\n',
        "solution.toml": '[[turn]]\nrun = "true"\n',
        "run-tests.sh": "exit 0\n",
    }
    for name, text in {**base, **files}.items():
        if text:
            (d / name).write_text(text)
    return d


def test_tasks_load_and_reject_what_is_malformed(tmp_path: Path) -> None:
    write_task(tmp_path)
    [t] = tasks.load_suite("shell", tmp_path)
    assert t.name == "shell/t1" and t.spec.workdir == "/app" and t.spec.depends_on == ("processes",)
    write_task(tmp_path, "t2", **{"task.toml": 'instruction = "x"\nimage_name = "typo"\n'})
    with pytest.raises(tasks.TaskError, match="image_name"):
        tasks.load_suite("shell", tmp_path)


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"run-tests.sh": ""}, "no run-tests.sh"),
        ({"solution.toml": "turn = []\n"}, "turn"),
        ({"task.toml": 'instruction = "x"\ndepends_on = ["memory"]\n'}, "depends_on"),
        ({"task.toml": "instruction = \n"}, "task.toml"),
    ],
)
def test_a_broken_task_is_a_clear_error(tmp_path: Path, files: dict[str, str], match: str) -> None:
    d = write_task(tmp_path, **files)
    if files.get("run-tests.sh") == "":
        (d / "run-tests.sh").unlink(missing_ok=True)
    with pytest.raises(tasks.TaskError, match=match):
        tasks.load_task(d)


def test_tar_of_a_task_dir_is_owned_by_root_and_keeps_modes(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "run.sh").write_text("echo hi\n")
    (tmp_path / "sub" / "run.sh").chmod(0o750)
    with tarfile.open(fileobj=__import__("io").BytesIO(tasks.tar_of(tmp_path))) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {"sub", "sub/run.sh"}
    assert members["sub/run.sh"].mode == 0o750 and members["sub/run.sh"].uid == 0


def test_the_shipped_suites_load() -> None:
    for suite in tasks.SUITES:
        assert tasks.load_suite(suite), suite


def test_llm_client_reads_tool_calls_usage_and_errors() -> None:
    script = [
        ScriptEntry(content="look first", tool_calls=(ScriptedToolCall(name="bash", arguments={"command": "ls"}),)),
        ScriptEntry(status=429, error="slow down"),
    ]
    with StandinServer(time_scale=0.0, script=script) as srv:
        url = f"{srv.url}/v1"
        llm = ChatClient(url)
        c = llm.chat([{"role": "user", "content": "hi"}], user="k")
        assert c.finish_reason == "tool_calls" and c.content == "look first"
        assert [(t.name, t.args()) for t in c.tool_calls] == [("bash", {"command": "ls"})]
        assert c.message()["tool_calls"][0]["function"]["name"] == "bash"
        assert c.prompt_tokens == 1 and c.completion_tokens == 2
        with pytest.raises(LLMError, match="slow down") as err:
            llm.chat([{"role": "user", "content": "hi"}], user="k")
        assert err.value.status == 429
    with pytest.raises(LLMError):
        ChatClient(url, model="m", timeout_s=2).chat([{"role": "user", "content": "x"}])  # server gone


def turn(n: int, state: str) -> Any:
    return SimpleNamespace(number=n, checkpoint_state=state)


def test_resume_goes_back_to_the_first_lost_turn() -> None:
    ep = Episode(client=None, task=None, name="x")  # type: ignore[arg-type]
    ep.turn_index = {3: 0, 4: 1, 5: 2, 6: 3}
    assert lost_turns([turn(3, "done"), turn(4, "skipped"), turn(5, "pending"), turn(6, "")], 3) == [5, 6]
    assert ep.resume_after([5, 6], 4) == 2
    assert ep.resume_after([], 4) == 4  # nothing lost: go on where the agent was
    assert ep.resume_after([99], 4) == 4  # a turn the agent never began (the setup's)


def test_every_strategy_is_registered_with_its_policy() -> None:
    assert {n: (s.policy, s.wait) for n, s in STRATEGIES.items()} == {
        "none": ("none", False),
        "restart": ("none", False),
        "chat-only": ("none", False),
        "chat+fs": ("fs", False),
        "full-every-turn": ("full", True),
        "crab": ("auto", False),
    }


def result(task: str, strategy: str, seconds: float, solved: bool = True, **kw: Any) -> Result:
    return Result(task, strategy, "", -1, solved, seconds, 4, 4, 0, 0.0, kw.pop("bytes_written", 0), 1, **kw)


def test_report_summaries_ratios_and_files(tmp_path: Path) -> None:
    ref = {"a": 10.0, "b": 20.0}
    crab = [
        result("a", "crab", 10.1, exposed_s=[0.0, 0.001], bytes_written=100, decisions={"skip": 3, "full": 1}),
        result("b", "crab", 20.4, exposed_s=[0.002], bytes_written=300, decisions={"fs": 1}),
    ]
    s = summarize(crab, ref)
    assert s["correctness"] == 1.0 and s["bytes_written"] == 400
    assert s["time_ratio_median"] == pytest.approx((1.01 + 1.02) / 2)
    assert s["decisions"] == {"skip": 3, "full": 1, "fs": 1}
    assert s["exposed_ms"]["max"] == pytest.approx(2.0)
    failed = summarize([result("a", "chat-only", 12.0, solved=False)], ref)
    assert failed["correctness"] == 0.0 and failed["time_ratio_median"] is None
    doc = {
        "config": {"suite": "shell", "tasks": 2, "concurrency": 8, "seed": 1},
        "fault_free": {"crab": s},
        "faults": {"sandbox-kill": {"chat-only": failed, "crab": s}},
        "headline": ["**Traffic**: ..."],
    }
    md = "\n".join(markdown(doc))
    assert "| crab | 2/2 | 1.015 |" in md and "| chat-only | 0/1 (0%) | - |" in md
    pngs = plots(doc, {"crab": [0.0, 0.001, 0.002]}, tmp_path)
    assert [p.name for p in pngs] == ["correctness.png", "traffic.png", "exposed_cdf.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)
    json.dumps(doc)
