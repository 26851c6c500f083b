"""crabd.integrations.minisweagent without crabd: step bookkeeping, recovery's replay, rollback, fork, errors.

A fake client and sandbox stand for crab's SDK: each command is recorded as
an *effect* of the turn it ran in; a checkpoint is taken at every turn end
(unless told otherwise); a killed sandbox's recovery drops the effects of the
turns after its latest checkpoint and reports those turns lost, as crabd does.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest
from minisweagent.environments import get_environment, get_environment_class
from minisweagent.exceptions import Submitted
from pydantic import ValidationError

from crabd.errors import CrabError, DaemonUnavailable, InitUnavailable, QuotaExceeded, RequestTooLarge, SandboxDead
from crabd.integrations.minisweagent import SUBMIT_MARKER, CrabEnvironment, CrabEnvironmentError
from crabd.models import CheckpointPolicy
from crabd.sdk import ExecResult, OutputChunk

PATH = "crabd.integrations.minisweagent.CrabEnvironment"
Handler = Callable[["FakeSandbox", str], tuple[int, bytes, bytes, bool]]


def ok(sb: FakeSandbox, command: str) -> tuple[int, bytes, bytes, bool]:
    """Every command prints its text and exits 0 (``fail N``: exits N; ``slow``: times out)."""
    if command.startswith("fail "):
        return int(command.split()[1]), b"", b"failed\n", False
    if command == "slow":
        return 124, b"partial\n", b"", True
    return 0, f"ran {command}\n".encode(), b"", False


@dataclass
class FakeSandbox:
    client: FakeClient
    id: str
    name: str
    checkpoints_policy: str = CheckpointPolicy.AUTO
    origin: str = ""
    state: str = "running"
    last_turn: int = 0
    open_turn: int | None = None
    #: (turn, command) of every command whose effects the sandbox holds now.
    effects: list[tuple[int, str]] = field(default_factory=list)
    #: turn -> checkpoint id, for ended turns; turn 0: the creation (or fork) checkpoint.
    ckpts: dict[int, str] = field(default_factory=dict)
    #: Turns ended since the last restore or recovery (crab's "current line").
    line: list[int] = field(default_factory=list)
    ran: list[tuple[int, str]] = field(default_factory=list)
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    handler: Handler = ok
    #: Turn ends take no checkpoint while set (a checkpoint still pending when the container dies).
    hold_checkpoints: bool = False
    #: Die (raising ``dies_with``) when this command runs.
    die_on: str = ""
    dies_with: str = "raise"

    def __post_init__(self) -> None:
        self.session = FakeSession(self)
        if self.checkpoints_policy != CheckpointPolicy.NONE:
            self.ckpts.setdefault(0, self.origin or f"{self.id}-created")

    # --- what CrabEnvironment calls ---------------------------------------------------------

    def refresh(self) -> Any:
        return SimpleNamespace(
            state=self.state,
            turn=self.last_turn,
            turn_open=self.open_turn is not None,
            checkpoints=CheckpointPolicy(self.checkpoints_policy),
            origin=self.origin,
        )

    def _alive(self) -> None:
        if self.state != "running":
            raise SandboxDead(f"sandbox {self.name} is dead", sandbox=self.id)

    def run(self, argv: list[str], **kw: Any) -> ExecResult:
        self._alive()
        if self.open_turn is None:
            self.last_turn += 1
            self.open_turn = self.last_turn
        self.effects.append((self.open_turn, " ".join(argv)))
        return ExecResult(exit_code=0, stdout=b"", stderr=b"")

    def begin_turn(self) -> Any:
        self._alive()
        if self.open_turn is not None:
            self.end_turn()
        self.last_turn += 1
        self.open_turn = self.last_turn
        self.calls.append(("begin", self.last_turn))
        return SimpleNamespace(number=self.last_turn)

    def end_turn(self, *, wait: bool = False, decision: bool = True) -> Any:
        self._alive()
        n = self.open_turn
        assert n is not None, "no open turn"
        self.open_turn = None
        self.calls.append(("end", n, wait, decision))
        self.line.append(n)
        if self.checkpoints_policy != CheckpointPolicy.NONE and not self.hold_checkpoints:
            self.ckpts[n] = f"{self.id}-t{n}"
        return SimpleNamespace(number=n)

    def checkpoints(self) -> list[Any]:
        return [SimpleNamespace(id=c, turn=t, sandbox_id=self.id, branch=0) for t, c in sorted(self.ckpts.items())]

    def turns(self) -> list[Any]:
        return [SimpleNamespace(number=t, state_checkpoint=self.ckpts.get(t, "")) for t in range(1, self.last_turn + 1)]

    def restore(self, checkpoint: str | None = None, *, turn: int | None = None) -> Any:
        self._alive()
        self.calls.append(("restore", checkpoint, turn))
        if turn is not None:
            self.effects = [e for e in self.effects if e[0] <= turn]
        self.line = []
        return self.refresh()

    def fork(self, n: int = 1, checkpoint: str | None = None, *, name_prefix: str = "", turn: int | None = None) -> Any:
        assert turn is not None
        return self.client.make_forks(self, n, self.ckpts[turn], [e for e in self.effects if e[0] <= turn])

    def recover(self) -> Any:
        if self.state == "running":
            raise CrabError(f"sandbox {self.name} is running: nothing to recover")
        head = max(t for t in self.ckpts if t <= self.last_turn)
        lost = [t for t in self.line if t > head]
        if self.open_turn is not None:
            lost.append(self.open_turn)
            self.open_turn = None
        self.effects = [e for e in self.effects if e[0] <= head]
        self.state, self.line = "running", []
        self.calls.append(("recover", head, lost))
        return SimpleNamespace(checkpoint=self.ckpts[head], checkpoint_turn=head, lost_turns=lost)

    def remove(self, force: bool = True) -> None:
        self.client.removed.append(self.id)
        self.client.live.pop(self.id, None)

    # --- the test's levers ------------------------------------------------------------------------

    def kill(self) -> None:
        self.state = "dead"

    def commands(self) -> list[str]:
        """The commands whose effects the sandbox holds, in order."""
        return [c for _, c in self.effects if not c.startswith(("sh ", "mkdir ", "bash "))]


class FakeSession:
    def __init__(self, sb: FakeSandbox) -> None:
        self.sb = sb
        #: Answers every command instead (the events it returns, or it raises).
        self.override: Callable[[str], list[OutputChunk | ExecResult]] | None = None

    def run(self, command: str, *, timeout: float = 0.0, turn: str = "") -> ExecResult:
        *_, result = self.stream(command, timeout=timeout, turn=turn)
        assert isinstance(result, ExecResult)
        return result

    def stream(self, command: str, *, timeout: float = 0.0, turn: str = "") -> Iterator[OutputChunk | ExecResult]:
        """As crabd: with ``turn``, the command is a turn of its own, ended even when the command fails."""
        if not turn:
            return self._events(command, timeout)
        sb = self.sb
        sb.begin_turn()
        try:
            events = list(self._events(command, timeout))
        finally:
            with contextlib.suppress(CrabError):
                sb.end_turn(wait=turn == "durable", decision=turn != "deferred")
        return iter(events)

    def _events(self, command: str, timeout: float) -> Iterator[OutputChunk | ExecResult]:
        sb = self.sb
        if self.override is not None:
            return iter(self.override(command))
        sb._alive()
        if sb.open_turn is None:
            sb.last_turn += 1
            sb.open_turn = sb.last_turn
        if sb.die_on and command == sb.die_on:
            sb.die_on = ""
            sb.kill()
            if sb.dies_with == "raise":
                raise InitUnavailable("lost the connection to crab's init", sandbox=sb.id)
            return iter([ExecResult(exit_code=137, stdout=b"", stderr=b"", session_ended=True)])
        sb.ran.append((sb.open_turn, command))
        code, out, err, timed_out = sb.handler(sb, command)
        if not timed_out:
            sb.effects.append((sb.open_turn, command))
        result = ExecResult(
            exit_code=code, stdout=out, stderr=err, timed_out=timed_out, session_ended=timed_out, turn=sb.open_turn
        )
        chunks = [OutputChunk("stdout", out)] if out else []
        chunks += [OutputChunk("stderr", err)] if err else []
        return iter([*chunks, result])


@dataclass
class FakeClient:
    socket: str = "/fake/crabd.sock"
    live: dict[str, FakeSandbox] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    created: list[dict[str, Any]] = field(default_factory=list)
    refuse: CrabError | None = None
    closed: bool = False
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def create(self, env: str, **kw: Any) -> FakeSandbox:
        if self.refuse is not None:
            raise self.refuse
        self.created.append({"env": env, **kw})
        i = next(self.ids)
        sb = FakeSandbox(self, f"sb{i}", kw.get("name") or f"box{i}", checkpoints_policy=kw["checkpoints"])
        self.live[sb.id] = sb
        return sb

    def make_forks(self, parent: FakeSandbox, n: int, ckpt: str, effects: list[tuple[int, str]]) -> list[FakeSandbox]:
        out = []
        for _ in range(n):
            i = next(self.ids)
            sb = FakeSandbox(self, f"sb{i}", f"fork{i}", checkpoints_policy=parent.checkpoints_policy, origin=ckpt)
            sb.effects = [(0, c) for _, c in effects]
            self.live[sb.id] = sb
            out.append(sb)
        return out

    def fork(self, checkpoint: str, n: int = 1, *, name_prefix: str = "") -> list[FakeSandbox]:
        owner = next(s for s in self.live.values() if checkpoint in s.ckpts.values())
        turn = next(t for t, c in owner.ckpts.items() if c == checkpoint)
        return self.make_forks(owner, n, checkpoint, [e for e in owner.effects if e[0] <= turn])

    def close(self) -> None:
        self.closed = True


def make(client: FakeClient | None = None, **kw: Any) -> tuple[CrabEnvironment, FakeSandbox, FakeClient]:
    client = client or FakeClient()
    env = CrabEnvironment(client=cast(Any, client), **kw)
    sb = cast(FakeSandbox, env.sandbox)
    return env, sb, client


def run(env: CrabEnvironment, command: str) -> dict[str, Any]:
    return env.execute({"command": command})


# --- the protocol, and one command per turn ---------------------------------------------------------


def test_it_is_selectable_by_import_path_and_validates_its_config_before_any_sandbox() -> None:
    assert get_environment_class(PATH) is CrabEnvironment
    with pytest.raises(ValidationError, match="unknown checkpoint policy 'sometimes'"):
        get_environment({"environment_class": PATH, "checkpoints": "sometimes", "socket": "/nonexistent.sock"})


def test_each_command_is_one_turn_ended_without_waiting_and_the_output_is_mini_swe_agents() -> None:
    env, sb, client = make(cwd="/work", env={"PAGER": "cat"}, image="busybox", sandbox_name="mine")
    assert client.created == [
        {"env": "busybox", "name": "mine", "workdir": "/work", "env_vars": {"PAGER": "cat"}, "checkpoints": "auto"}
    ]
    assert run(env, "ls") == {"output": "ran ls\n", "returncode": 0, "exception_info": ""}
    assert run(env, "fail 2") == {"output": "failed\n", "returncode": 2, "exception_info": ""}
    assert env.execute({"command": "pwd"}, cwd="/tmp")["output"] == "ran cd -- /tmp && pwd\n"
    assert sb.calls == [
        ("begin", 1),
        ("end", 1, False, False),
        ("begin", 2),
        ("end", 2, False, False),
        ("begin", 3),
        ("end", 3, False, False),
    ]
    assert [(s.step, s.turn, s.returncode, s.command) for s in env.steps] == [
        (1, 1, 0, "ls"),
        (2, 2, 2, "fail 2"),
        (3, 3, 0, "cd -- /tmp && pwd"),
    ]
    assert env.checkpoint_of(2) == "sb1-t2" and env.checkpoint_of(0) == "sb1-created"
    with pytest.raises(ValueError, match="no step 4"):
        env.checkpoint_of(4)
    info = env.serialize()["info"]
    assert info["config"]["environment_type"] == PATH and info["crab"]["sandbox_id"] == "sb1"
    assert [s["turn"] for s in info["crab"]["steps"]] == [1, 2, 3]
    tv = env.get_template_vars(extra=1)
    assert tv["crab_sandbox_name"] == "mine" and tv["extra"] == 1 and {"system", "release", "machine"} <= set(tv)


def test_the_trajectory_names_each_steps_checkpoint_once_it_exists_and_the_submission_waits_for_them() -> None:
    env, sb, _ = make()
    run(env, "ls")
    sb.hold_checkpoints = True  # step 2's checkpoint is still being taken when the agent saves
    run(env, "pwd")
    saved = [s["checkpoint_id"] for s in env.serialize()["info"]["crab"]["steps"]]
    assert saved == ["sb1-t1", ""]  # what exists is named; what is pending is not waited for
    sb.hold_checkpoints = False
    sb.ckpts[2] = "sb1-t2"  # taken since
    assert [s["checkpoint_id"] for s in env.serialize()["info"]["crab"]["steps"]] == ["sb1-t1", "sb1-t2"]
    # The submitting step settles them all, so the last save of the run names every checkpoint.
    sb.handler = lambda sb, command: (0, f"{SUBMIT_MARKER}\n".encode(), b"", False)
    sb.hold_checkpoints = True
    listed = sb.checkpoints

    def settle() -> list[Any]:  # crab's checkpoint list waits for the last turn's checkpoint
        sb.ckpts[3] = "sb1-t3"
        return listed()

    sb.checkpoints = settle  # type: ignore[method-assign]
    with pytest.raises(Submitted):
        run(env, f"echo {SUBMIT_MARKER}")
    assert sb.calls[-1] == ("end", 3, False, False)  # the turn itself still ends without waiting
    info = env.serialize()["info"]["crab"]
    assert [s["checkpoint_id"] for s in info["steps"]] == ["sb1-t1", "sb1-t2", "sb1-t3"]
    assert info["start"]["checkpoint_id"] == "sb1-created"


def test_stdout_and_stderr_come_interleaved_and_the_submit_marker_ends_the_run() -> None:
    env, sb, _ = make()

    def handler(sb: FakeSandbox, command: str) -> tuple[int, bytes, bytes, bool]:
        return 0, b"COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\npatch\n", b"", False

    sb.handler = handler
    with pytest.raises(Submitted) as done:
        run(env, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch")
    assert done.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": "patch\n"}
    assert len(env.steps) == 1  # the submission was a step (a turn) too

    sb.session.override = lambda command: [
        OutputChunk("stdout", b"a\n"),
        OutputChunk("stderr", b"oops\n"),
        OutputChunk("stdout", b"b\n"),
        ExecResult(exit_code=1, stdout=b"a\nb\n", stderr=b"oops\n"),
    ]
    assert run(env, "x")["output"] == "a\noops\nb\n"


def test_a_timeout_is_an_observation_as_in_mini_swe_agents_docker_environment() -> None:
    env, _, _ = make(timeout=7)
    out = run(env, "slow")
    assert out["returncode"] == -1 and out["output"] == "partial\n"
    assert out["extra"]["exception_type"] == "TimeoutExpired"
    assert "Command 'slow' timed out after 7 seconds" in out["exception_info"]
    assert env.steps[-1].returncode == -1
    assert "after 3 seconds" in env.execute({"command": "slow"}, timeout=3)["exception_info"]


def test_a_command_crab_refuses_is_an_observation_and_no_step() -> None:
    env, sb, _ = make()

    def too_large(command: str) -> list[OutputChunk | ExecResult]:
        raise RequestTooLarge("the command is 9 MiB; the limit is 1 MiB", size=9, limit=1)

    sb.session.override = too_large
    out = run(env, "x" * 10)
    assert out["returncode"] == -1 and out["extra"]["exception_type"] == "RequestTooLarge"
    assert "the limit is 1 MiB" in out["exception_info"]
    assert env.steps == ()


# --- errors of the environment itself ---------------------------------------------------------------


def test_crabd_unreachable_is_a_crab_environment_error_with_crabs_error_chained() -> None:
    with pytest.raises(CrabEnvironmentError, match="crabd is unreachable") as raised:
        get_environment({"environment_class": PATH, "socket": "/nonexistent/crabd.sock"})
    assert isinstance(raised.value, RuntimeError)
    assert isinstance(raised.value.crab_error, DaemonUnavailable)
    assert "/nonexistent/crabd.sock" in str(raised.value)


def test_a_refused_creation_raises_and_a_failed_preparation_leaks_no_sandbox() -> None:
    full = QuotaExceeded(
        "uid 1000: 8 sandboxes, the limit is 8", uid=1000, quota="sandboxes", limit=8, used=8, requested=1
    )
    client = FakeClient(refuse=full)
    with pytest.raises(CrabEnvironmentError, match="the limit is 8") as raised:
        make(client)
    assert isinstance(raised.value.__cause__, QuotaExceeded)
    assert not client.closed  # the caller's client stays open

    client = FakeClient()
    real_create = client.create

    def create_then_break(env: str, **kw: Any) -> FakeSandbox:
        sb = real_create(env, **kw)
        sb.state = "dead"  # the task's files cannot be copied in
        return sb

    client.create = create_then_break  # type: ignore[method-assign]
    with pytest.raises(CrabEnvironmentError, match="could not prepare") as raised:
        make(client, crab_task="shell/kv-server", keep_sandbox=True)  # kept only once it works
    assert isinstance(raised.value.__cause__, SandboxDead)
    assert client.live == {} and client.removed == ["sb1"]
    # A sandbox the caller gave stays the caller's when the environment cannot take it over.
    theirs = FakeClient().create("bookworm", checkpoints="auto")
    theirs.kill()
    with pytest.raises(CrabEnvironmentError, match="could not prepare"):
        CrabEnvironment(client=cast(Any, theirs.client), sandbox=cast(Any, theirs), env={"A": "1"})
    assert theirs.client.removed == []
    with pytest.raises(CrabEnvironmentError, match="no task"):
        make(FakeClient(), crab_task="shell/no-such-task")


def test_a_task_is_prepared_and_its_setup_turn_is_the_durable_start() -> None:
    env, sb, client = make(crab_task="shell/kv-server")
    assert client.created[0]["env"] == "bookworm" and client.created[0]["workdir"] == "/app"
    # The preparation ran as an implicit turn (1); it ends at once, waited for: that state is step 0.
    assert sb.calls == [("end", 1, True, False)]
    assert env.checkpoint_of(0) == "sb1-t1" and not env.steps
    run(env, "ls")
    assert [s.turn for s in env.steps] == [2]


def test_cleanup_removes_the_sandbox_once_and_keep_sandbox_keeps_it() -> None:
    env, _, client = make()
    env.cleanup()
    env.cleanup()
    assert client.removed == ["sb1"]
    with pytest.raises(CrabEnvironmentError, match="cleaned up"):
        run(env, "ls")
    with make(client, keep_sandbox=True)[0] as kept:
        kept_id = kept.sandbox.id
    assert kept_id in client.live


def test_other_crab_failures_while_running_raise_instead_of_reaching_the_model() -> None:
    env, sb, _ = make()

    def unreachable(command: str) -> list[OutputChunk | ExecResult]:
        raise DaemonUnavailable("cannot reach crabd at /fake/crabd.sock", socket="/fake/crabd.sock")

    sb.session.override = unreachable
    with pytest.raises(CrabEnvironmentError, match="crabd is unreachable") as raised:
        run(env, "ls")
    assert isinstance(raised.value.crab_error, DaemonUnavailable)
    assert sb.calls[-1] == ("end", 1, False, False)  # the turn was still closed


# --- recovery ------------------------------------------------------------------------------------------


def test_a_sandbox_dead_between_steps_is_recovered_and_the_lost_steps_rerun_before_the_failed_one() -> None:
    env, sb, _ = make()
    run(env, "one")
    sb.hold_checkpoints = True  # steps 2 and 3 end without a durable checkpoint ...
    run(env, "two")
    run(env, "three")
    sb.kill()  # ... when the container dies, while the agent waits for its model
    assert run(env, "four") == {"output": "ran four\n", "returncode": 0, "exception_info": ""}
    assert sb.commands() == ["one", "two", "three", "four"]  # the same effects, in the same order
    assert [s.turn for s in env.steps] == [1, 4, 5, 6]  # two and three re-ran as new turns
    [rec] = env.recoveries
    assert (rec.checkpoint_turn, rec.lost_turns, rec.replayed_steps) == (1, (2, 3), (2, 3))
    assert "is dead" in rec.cause
    assert env.serialize()["info"]["crab"]["recoveries"][0]["replayed_steps"] == [2, 3]  # JSON: lists


def test_a_sandbox_dying_during_a_command_is_recovered_and_the_command_rerun() -> None:
    for how in ("raise", "session_ended"):
        env, sb, _ = make()
        run(env, "one")
        run(env, "two")
        sb.die_on, sb.dies_with = "three", how
        assert run(env, "three")["output"] == "ran three\n"
        assert sb.commands() == ["one", "two", "three"]
        assert env.recoveries[0].lost_turns == (3,) and env.recoveries[0].replayed_steps == ()
        assert [s.turn for s in env.steps] == [1, 2, 4]


def test_a_command_that_ends_the_session_in_a_live_sandbox_is_just_its_output() -> None:
    env, sb, _ = make()
    sb.session.override = lambda command: [ExecResult(exit_code=3, stdout=b"", stderr=b"", session_ended=True)]
    assert run(env, "exit 3")["returncode"] == 3 and env.recoveries == []


def test_without_checkpoints_or_recovery_a_dead_sandbox_is_an_error() -> None:
    for kw in ({"checkpoints": "none"}, {"recover": False}):
        env, sb, _ = make(**kw)
        run(env, "one")
        sb.kill()
        with pytest.raises(CrabEnvironmentError, match="recovery is off") as raised:
            run(env, "two")
        assert isinstance(raised.value.crab_error, SandboxDead)


def test_recovery_gives_up_after_max_recoveries() -> None:
    env, sb, _ = make(max_recoveries=2)
    run(env, "one")
    real = sb.recover

    def recover_into_a_dying_sandbox() -> Any:
        got = real()
        sb.kill()
        return got

    sb.recover = recover_into_a_dying_sandbox  # type: ignore[method-assign]
    sb.kill()
    with pytest.raises(CrabEnvironmentError, match="died again after 2 recoveries"):
        run(env, "two")


def test_recover_by_hand_replays_and_says_what_it_did() -> None:
    env, sb, _ = make()
    run(env, "one")
    sb.hold_checkpoints = True
    run(env, "two")
    sb.kill()
    rec = env.recover()
    assert rec.replayed_steps == (2,) and sb.commands() == ["one", "two"]
    with pytest.raises(CrabEnvironmentError, match="nothing to recover"):
        env.recover()


# --- rollback and fork ------------------------------------------------------------------------------


def test_rollback_restores_a_steps_turn_and_forgets_the_later_steps() -> None:
    env, sb, _ = make()
    for c in ("one", "two", "three"):
        run(env, c)
    env.rollback(1)
    assert sb.calls[-1] == ("restore", None, 1) and sb.commands() == ["one"]
    assert [s.step for s in env.steps] == [1]
    run(env, "two-b")
    assert [(s.step, s.turn) for s in env.steps] == [(1, 1), (2, 4)]
    env.rollback(0)
    assert sb.calls[-1] == ("restore", None, 0) and env.steps == ()
    with pytest.raises(ValueError, match="no step 5"):
        env.rollback(5)


def test_forks_start_from_a_steps_state_with_its_steps_and_share_the_client_until_the_last_is_gone() -> None:
    client = FakeClient()
    env, _, _ = make(client, sandbox_name="p")
    for command in ("one", "two", "three"):
        run(env, command)
    a, b = env.fork(2, step=2)
    assert [s.command for s in a.steps] == ["one", "two"] and a.steps[1].checkpoint_id == "sb1-t2"
    fa = cast(FakeSandbox, a.sandbox)
    assert fa.commands() == ["one", "two"] and fa.origin == "sb1-t2"
    run(a, "three-a")
    assert [(s.step, s.sandbox_id, s.turn) for s in a.steps][-1] == (3, fa.id, 1)
    a.rollback(2)  # a step of the parent: by its checkpoint id, which the fork may restore
    assert fa.calls[-1] == ("restore", "sb1-t2", None) and len(a.steps) == 2
    # A fork of a fork's inherited step goes through the client, by checkpoint id.
    [c] = a.fork(1, step=1)
    assert cast(FakeSandbox, c.sandbox).origin == "sb1-t1"
    assert b.config.sandbox_name == cast(FakeSandbox, b.sandbox).name != "p"

    env.cleanup()
    assert not client.closed  # the caller's client: never closed by the environments
    for e in (a, b, c):
        e.cleanup()
    assert set(client.removed) == {"sb1", "sb2", "sb3", "sb4"} and client.live == {}


def test_an_owned_client_is_closed_with_the_last_environment_that_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[FakeClient] = []

    def client_factory(socket: str | None = None) -> FakeClient:
        made.append(FakeClient(socket=socket or "default"))
        return made[-1]

    monkeypatch.setattr("crabd.integrations.minisweagent.Client", client_factory)
    env = CrabEnvironment(socket="/run/x.sock")
    run(env, "one")
    [child] = env.fork(1)
    env.cleanup()
    assert made[0].socket == "/run/x.sock" and not made[0].closed
    child.cleanup()
    assert made[0].closed


def test_environments_left_alive_are_cleaned_up_at_exit() -> None:
    from crabd.integrations.minisweagent import _cleanup_at_exit

    client = FakeClient()
    left, _, _ = make(client)
    kept, _, _ = make(client, keep_sandbox=True)
    forks = left.fork(1)
    _cleanup_at_exit()
    assert sorted(client.removed) == ["sb1", "sb3"]
    with pytest.raises(CrabEnvironmentError, match="cleaned up"):
        forks[0].execute({"command": "ls"})
    assert list(client.live) == ["sb2"]  # keep_sandbox: left for crabctl
    kept.cleanup()


def test_an_adopted_sandbox_gets_the_sessions_variables_and_directory_and_is_removed_at_cleanup() -> None:
    client = FakeClient()
    theirs = client.create("bookworm", checkpoints="auto")
    env = CrabEnvironment(client=cast(Any, client), sandbox=cast(Any, theirs), env={"A": "x y"}, cwd="/srv")
    assert theirs.ran == [(1, "export A='x y'\ncd -- /srv")]
    assert theirs.calls == [("end", 1, True, False)] and env.checkpoint_of(0) == "sb1-t1"
    env.cleanup()
    assert client.removed == ["sb1"]
