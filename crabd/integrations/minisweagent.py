"""A mini-swe-agent environment backed by a crab sandbox (docs/minisweagent.md).

mini-swe-agent (https://mini-swe-agent.com) runs each action of its agent
through an *environment*: ``execute({"command": ...})`` returns
``{"output", "returncode", "exception_info"}``.  :class:`CrabEnvironment`
is one, selectable by import path::

    mini --environment-class crabd.integrations.minisweagent.CrabEnvironment ...
    # or, in a config file:  environment: {environment_class: crabd.integrations.minisweagent.CrabEnvironment}

Each ``execute`` is one crab turn in the sandbox's persistent bash session,
made in one call (``session.stream(..., turn="deferred")``: the turn begun,
the command, its end not waited for), so crab decides and checkpoints while
the agent waits for its model.  On top of
mini-swe-agent's own environments it adds, for the caller:

* per step, the crab turn that ran it and the checkpoint holding the state
  it ended in (:attr:`CrabEnvironment.steps`, :meth:`~CrabEnvironment.checkpoint_of`);
* :meth:`~CrabEnvironment.rollback` to the end of any step (files and
  session), and :meth:`~CrabEnvironment.fork` into new environments;
* recovery: when the sandbox's container dies, the environment recovers it
  from its latest checkpoint, re-runs the steps whose effects that lost, and
  then the command that failed, so the agent's run goes on as if nothing
  happened (:meth:`~CrabEnvironment.recover`).

Failures keep mini-swe-agent's conventions: a command that times out is an
observation for the model (``returncode`` -1, ``exception_info``, and
``extra.exception_type`` "TimeoutExpired", as its docker environment reports
it); crabd unreachable, a sandbox crab refuses to create, or one that cannot
be recovered raise :class:`CrabEnvironmentError` (a ``RuntimeError``, as
mini-swe-agent raises for a broken environment) with crab's error chained.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import platform
import shlex
import sys
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge

from crabd.errors import (
    ClientClosed,
    CrabError,
    DaemonUnavailable,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    SandboxBusy,
    SandboxDead,
)
from crabd.integrations.minisweagent_data import (
    SET_HERE,
    SUBMIT_MARKER,
    CrabEnvironmentConfig,
    CrabEnvironmentError,
    CrabRecovery,
    CrabStep,
    Ran,
    collect,
    failure,
    output,
    why,
)
from crabd.models import CheckpointPolicy, SandboxState, TurnEnd
from crabd.sdk import Client, Sandbox

if TYPE_CHECKING:
    from agents.tasks import Task
    from agents.tasks import Verdict as TaskVerdict

# The records and the config live in minisweagent_data; this is where callers import them from.
__all__ = [
    "SUBMIT_MARKER",
    "CrabEnvironment",
    "CrabEnvironmentConfig",
    "CrabEnvironmentError",
    "CrabRecovery",
    "CrabStep",
]


def _find_task(name: str) -> Task:
    """``crab_task``'s task, from crab's task suites (``agents.tasks``, ``envs/tasks``).

    The suites are in a crab checkout, not in the package: they are imported
    only when ``crab_task`` is set, and without a checkout on the path the
    error says so instead of a bare ModuleNotFoundError.
    """
    try:
        from agents.tasks import TaskError, find
    except ModuleNotFoundError as exc:
        if exc.name not in ("agents", "agents.tasks"):
            raise
        raise CrabEnvironmentError(
            "crab_task names a task of crab's suites (envs/tasks), which only a crab checkout has: "
            "run with the checkout on the Python path (PYTHONPATH=/path/to/crab), "
            "or leave crab_task unset and prepare the sandbox yourself"
        ) from exc
    try:
        return find(name)
    except TaskError as exc:
        raise CrabEnvironmentError(f"crab task {name!r}: {exc}") from exc


class _Died(Exception):
    """A command's session ended because the sandbox's container died (not a crab error: the call succeeded)."""


@dataclass
class _SharedClient:
    """A crab client shared by an environment and its forks; closed with the last of them if they opened it."""

    client: Client
    owned: bool
    users: int = 0

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0 and self.owned:
            self.client.close()


class CrabEnvironment:
    """A mini-swe-agent environment whose commands run in a crab sandbox's persistent bash session.

    Keyword arguments are :class:`CrabEnvironmentConfig`'s.  From Python,
    ``client`` (a :class:`crabd.sdk.Client`) and ``sandbox`` (a sandbox to
    adopt: its state is the start; it is removed at cleanup like one made
    here) may be passed too.  Use ``with`` or call :meth:`cleanup`;
    an environment left without either removes its sandbox when it is
    garbage-collected or the interpreter exits (mini-swe-agent's own runners
    never call ``cleanup``; its docker environment relies on ``__del__`` too).
    """

    def __init__(
        self,
        *,
        config_class: type[CrabEnvironmentConfig] = CrabEnvironmentConfig,
        logger: logging.Logger | None = None,
        client: Client | None = None,
        sandbox: Sandbox | None = None,
        **kwargs: Any,
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self._shared: _SharedClient | None = None
        self._sb: Sandbox | None = None
        self._steps: list[CrabStep] = []
        self._origin = CrabStep(0, "", 0, "", 0)
        #: Steps from this index on lost their effects in a recovery and are still to be re-run.
        self._replay_from: int | None = None
        self.recoveries: list[CrabRecovery] = []
        self.config = config_class(**kwargs)
        self.task: Task | None = None
        try:
            if self.config.crab_task:
                self.task = _find_task(self.config.crab_task)
            shared = _SharedClient(client or Client(self.config.socket or None), owned=client is None)
            shared.users += 1
            self._shared = shared
            self._sb = sandbox or self._create()
            _LIVE.add(self)
            self._begin(adopted=sandbox is not None)
        except BaseException as exc:
            # Nothing is left behind: the sandbox made here goes (a sandbox the caller gave stays theirs).
            self._close(remove=sandbox is None)
            if isinstance(exc, DaemonUnavailable):
                raise CrabEnvironmentError(f"crabd is unreachable: {exc.describe()}") from exc
            if isinstance(exc, CrabError):
                raise CrabEnvironmentError(f"crab could not prepare a sandbox: {exc.describe()}") from exc
            raise

    def _create(self) -> Sandbox:
        env_vars = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None}
        env_vars.update(self.config.env)
        task = self.task
        image = task.spec.image if task else self.config.image
        workdir = self.config.cwd or (task.spec.workdir if task else "/")
        opts = {k: v for k, v in self.config.create_options.items() if k not in SET_HERE}
        sb = self.client.create(
            image,
            name=self.config.sandbox_name,
            workdir=workdir,
            env_vars=env_vars,
            checkpoints=self.config.checkpoints,
            **opts,
        )
        try:
            if task is not None:
                from agents.tasks import TaskError, prepare

                try:
                    prepare(sb, task)
                except TaskError as exc:
                    raise CrabEnvironmentError(f"crab task {task.name!r}: {exc}") from exc
        except BaseException:
            with contextlib.suppress(CrabError):
                sb.remove(force=True)
            raise
        return sb

    def _begin(self, *, adopted: bool) -> None:
        """Settle the starting state: the turn that prepared it ends now, durably; it is step 0."""
        sb = self.sandbox
        if adopted:
            # A sandbox made elsewhere: give its session this environment's directory and variables.
            env = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None}
            env.update(self.config.env)
            setup = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
            if self.config.cwd:
                setup.append(f"cd -- {shlex.quote(self.config.cwd)}")
            if setup:
                r = sb.session.run("\n".join(setup), timeout=60)
                if r.exit_code != 0:
                    raise InvalidRequest(f"setting up the session failed: {(r.stdout + r.stderr)[-500:]!r}")
        info = sb.refresh()
        turn = info.turn
        if info.turn_open:
            # Waited for: the start is then restorable (and a recovery never has to redo the setup).
            turn = sb.end_turn(wait=info.checkpoints is not CheckpointPolicy.NONE, decision=False).number
        self._origin = CrabStep(0, "", 0, sb.id, turn)

    # --- lifetime ---------------------------------------------------------------------------

    @property
    def client(self) -> Client:
        if self._shared is None:
            raise CrabEnvironmentError("this CrabEnvironment has no crab client (it was cleaned up)")
        return self._shared.client

    @property
    def sandbox(self) -> Sandbox:
        """The crab sandbox (a :class:`crabd.sdk.Sandbox`)."""
        if self._sb is None:
            raise CrabEnvironmentError("this CrabEnvironment has no sandbox (it was cleaned up)")
        return self._sb

    def cleanup(self) -> None:
        """Remove the sandbox (unless ``keep_sandbox``) and close the client; safe to call twice."""
        config = getattr(self, "config", None)
        self._close(remove=config is not None and not config.keep_sandbox)

    def _close(self, *, remove: bool) -> None:
        _LIVE.discard(self)
        sb, self._sb = getattr(self, "_sb", None), None
        shared, self._shared = getattr(self, "_shared", None), None
        try:
            if sb is not None and remove:
                try:
                    sb.remove(force=True)
                except (NotFound, ClientClosed):
                    pass
                except CrabError as exc:
                    self.logger.warning("could not remove crab sandbox %s: %s", sb.name, exc.describe())
        finally:
            if shared is not None:
                shared.release()

    close = cleanup

    def __enter__(self) -> CrabEnvironment:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.cleanup()

    def __del__(self) -> None:
        if sys.is_finalizing():
            return
        with contextlib.suppress(Exception):
            self.cleanup()

    # --- mini-swe-agent's Environment protocol -------------------------------------------------

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in the sandbox's session as one crab turn; mini-swe-agent's result dict.

        ``cwd``: run it there (a ``cd`` in front; the session is persistent,
        so the directory stays).  ``timeout``: seconds, default the config's.
        Raises :class:`~minisweagent.exceptions.Submitted` when the output
        says the task is done, as mini-swe-agent's environments do.
        """
        command = str(action.get("command", ""))
        text = f"cd -- {shlex.quote(cwd)} && {command}" if cwd else command
        limit = timeout or self.config.timeout
        try:
            step = self._step(text, limit)
        except InvalidRequest as exc:
            # The command cannot be sent as given (too large, ...): the model can change it.
            output = failure(exc)
        else:
            output = step.output
        self._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        sb = self._sb
        crab = {"crab_sandbox_id": sb.id if sb else "", "crab_sandbox_name": sb.name if sb else ""}
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), crab, kwargs)

    def serialize(self) -> dict[str, Any]:
        """The environment's part of the trajectory (mini-swe-agent saves it after every step).

        Each step carries the id of the checkpoint holding its end state as
        soon as that checkpoint exists: one still being taken is not waited
        for here (the agent would wait on it at every step), it is filled
        in by a later save, and the submitting step waits for all of them.
        """
        self._note_checkpoints()
        sb = self._sb
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                },
                "crab": {
                    "sandbox_id": sb.id if sb else "",
                    "sandbox_name": sb.name if sb else "",
                    "start": self._origin.to_json(),
                    "steps": [s.to_json() for s in self._steps],
                    "recoveries": [r.to_json() for r in self.recoveries],
                },
            }
        }

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raise Submitted if the output says the task is done (mini-swe-agent's environments' rule)."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            # The run ends here and the trajectory's last save follows: wait for the steps' checkpoints so
            # that it names every one (a failure to read them costs the ids, not the submission).
            try:
                self._resolve_checkpoints()
            except CrabEnvironmentError as exc:
                self.logger.warning("could not read the steps' checkpoints: %s", exc)
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )

    # --- steps --------------------------------------------------------------------------------

    @property
    def steps(self) -> tuple[CrabStep, ...]:
        """The steps so far on the current line of history (a rollback or recovery moves it)."""
        return tuple(self._steps)

    def _record(self, step: int) -> CrabStep:
        if not 0 <= step <= len(self._steps):
            raise ValueError(f"no step {step}: this environment has steps 0 (its start) to {len(self._steps)}")
        return self._steps[step - 1] if step else self._origin

    def checkpoint_of(self, step: int) -> str:
        """The id of the checkpoint holding the state at the end of ``step`` (0: the start); "" if none does.

        None does under the policy ``none``, or when that turn's checkpoint
        failed.  Waits for a checkpoint still being taken.
        """
        rec = self._record(step)
        if not rec.checkpoint_id and rec.sandbox_id == self.sandbox.id:
            self._resolve_checkpoints()
        return rec.checkpoint_id

    def _resolve_checkpoints(self) -> None:
        sb = self.sandbox
        try:
            ckpts = sb.checkpoints()  # settles: the last turn's checkpoint is durable (or failed) now
            turns = {t.number: t for t in sb.turns()}
            info = sb.refresh()
        except CrabError as exc:
            raise self._error("reading the sandbox's checkpoints", exc) from exc
        for rec in (self._origin, *self._steps):
            if rec.sandbox_id != sb.id or rec.checkpoint_id:
                continue
            if rec.turn == 0:
                created = [c.id for c in ckpts if c.turn == 0 and c.sandbox_id == sb.id and c.branch == 0]
                rec.checkpoint_id = info.origin or (created[0] if created else "")
            elif (t := turns.get(rec.turn)) is not None:
                rec.checkpoint_id = t.state_checkpoint

    def _note_checkpoints(self) -> None:
        """Fill in the checkpoint of every step whose turn's checkpoint exists by now, without waiting for any."""
        sb = self._sb
        missing = [
            r for r in (self._origin, *self._steps) if sb and r.turn and r.sandbox_id == sb.id and not r.checkpoint_id
        ]
        if sb is None or not missing:
            return
        try:
            turns = {t.number: t for t in sb.turns()}
        except CrabError as exc:  # the trajectory is saved all the same; checkpoint_of() can ask again
            self.logger.debug("could not read the turns of %s: %s", sb.name, exc.describe())
            return
        for rec in missing:
            if (t := turns.get(rec.turn)) is not None:
                rec.checkpoint_id = t.state_checkpoint

    def _ref(self, step: int) -> tuple[int | None, str | None]:
        """How crab names the state at the end of ``step``: this sandbox's turn, or a checkpoint id."""
        rec = self._record(step)
        if rec.sandbox_id == self.sandbox.id:
            return rec.turn, None
        if not rec.checkpoint_id:
            raise CrabEnvironmentError(f"no checkpoint is known for step {step} (it ran in another sandbox)")
        return None, rec.checkpoint_id

    def rollback(self, step: int) -> None:
        """Put the sandbox back to the end of ``step`` (0: the start): its files and its session's state.

        The steps after it are forgotten (the next ``execute`` is step
        ``step + 1``).  The agent's own message history is the caller's to
        cut back.  Processes come back when crab took a full checkpoint there.
        """
        turn, ckpt = self._ref(step)
        try:
            self.sandbox.restore(ckpt, turn=turn)
        except CrabError as exc:
            raise self._error(f"rolling back to step {step}", exc) from exc
        del self._steps[step:]
        self._replay_from = None

    def fork(self, n: int = 1, *, step: int | None = None, name_prefix: str = "") -> list[CrabEnvironment]:
        """``n`` new environments, each on its own new sandbox in the state at the end of ``step`` (default: now).

        Each has this one's configuration and its steps up to ``step``; each
        owns its sandbox (cleanup removes it).
        """
        k = len(self._steps) if step is None else step
        self._resolve_checkpoints()  # the forks refer to these steps by checkpoint id
        turn, ckpt = self._ref(k)
        try:
            if ckpt is None:
                made = self.sandbox.fork(n, turn=turn, name_prefix=name_prefix)
            else:
                made = self.client.fork(ckpt, n, name_prefix=name_prefix)
        except CrabError as exc:
            raise self._error(f"forking step {k}", exc) from exc
        out: list[CrabEnvironment] = []
        for i, sb in enumerate(made):
            try:
                out.append(self._adopt_fork(sb, k))
            except BaseException:
                for sb_left in made[i:]:
                    with contextlib.suppress(CrabError):
                        sb_left.remove(force=True)
                for env in out:
                    env.cleanup()
                raise
        return out

    def _adopt_fork(self, sb: Sandbox, step: int) -> CrabEnvironment:
        child = object.__new__(type(self))
        child.logger = self.logger
        child.config = self.config.model_copy(update={"sandbox_name": sb.name})
        child.task = self.task
        assert self._shared is not None
        child._shared = self._shared
        self._shared.users += 1
        child._sb = sb
        _LIVE.add(child)
        child._steps = [dataclasses.replace(s) for s in self._steps[:step]]
        child._origin = dataclasses.replace(self._origin)
        child._replay_from = None
        child.recoveries = []
        return child

    def verify(self) -> TaskVerdict:
        """Run the crab task's verifier in the sandbox (only with ``crab_task``)."""
        if self.task is None:
            raise CrabEnvironmentError("this environment has no crab_task to verify")
        from agents.tasks import TaskError, verify

        try:
            return verify(self.sandbox, self.task)
        except (CrabError, TaskError) as exc:
            raise CrabEnvironmentError(f"verifying {self.task.name}: {exc}") from exc

    # --- running a step, and recovery -----------------------------------------------------------

    def _step(self, text: str, limit: int) -> Ran:
        """Run one command as one turn, recovering the sandbox (and what it lost) when it died."""
        recoveries = 0
        while True:
            try:
                self._replay()
                ran = self._turn(text, limit)
                break
            except InvalidRequest:
                raise  # the command cannot be sent as given: execute() tells the model
            except (CrabError, _Died) as exc:
                if isinstance(exc, CrabError) and not self._dead(exc):
                    raise self._error("running a command", exc) from exc
                if not self.config.recover or self.config.checkpoints == CheckpointPolicy.NONE:
                    raise CrabEnvironmentError(f"the sandbox died and recovery is off: {why(exc)}") from exc
                if recoveries >= self.config.max_recoveries:
                    raise CrabEnvironmentError(
                        f"the sandbox died again after {recoveries} recoveries: {why(exc)}"
                    ) from exc
                recoveries += 1
                self._recover(exc.message if isinstance(exc, CrabError) else str(exc))
        n = len(self._steps) + 1
        self._steps.append(CrabStep(n, text, ran.output["returncode"], self.sandbox.id, ran.turn, timeout=limit))
        return ran

    def _turn(self, text: str, limit: int) -> Ran:
        # One call: the turn begun, the command, its end not waited for (crab decides and
        # checkpoints while the agent waits for its model); a failed command still ends its turn.
        result, data = collect(self.sandbox.session.stream(text, timeout=limit, turn=TurnEnd.DEFERRED))
        if result.session_ended and not result.timed_out and not self._running():
            raise _Died(f"the sandbox's container died during turn {result.turn}")
        return Ran(result.turn, output(text, limit, result, data))

    def _running(self) -> bool:
        try:
            return self.sandbox.refresh().state == SandboxState.RUNNING
        except CrabError:
            return True  # cannot tell: not treated as dead

    def _dead(self, exc: BaseException) -> bool:
        """Did the command fail because the sandbox's container died?"""
        if isinstance(exc, (SandboxDead, _Died)):
            return True
        if isinstance(exc, (DaemonUnavailable, ClientClosed, NotFound, PermissionDenied, QuotaExceeded, SandboxBusy)):
            return False
        return not self._running()

    def _error(self, what: str, exc: CrabError) -> CrabEnvironmentError:
        if isinstance(exc, DaemonUnavailable):
            return CrabEnvironmentError(f"{what}: crabd is unreachable: {exc.describe()}")
        return CrabEnvironmentError(f"{what}: {exc.describe()}")

    def recover(self) -> CrabRecovery:
        """Recover the dead sandbox from its latest checkpoint and re-run the steps whose effects that lost.

        ``execute`` does this by itself (``recover=True``); this is for a
        caller that found the sandbox dead between steps.
        """
        self._recover("recovery asked for")
        try:
            self._replay()
        except CrabError as exc:
            raise self._error("re-running the lost steps", exc) from exc
        except _Died as exc:
            raise CrabEnvironmentError(f"re-running the lost steps: {exc}") from exc
        return self.recoveries[-1]

    def _recover(self, cause: str) -> None:
        """crab's recover, then mark the steps whose effects it lost for :meth:`_replay`.

        crab names the turns whose effects are gone (those after the
        checkpoint it recovered from); among this environment's steps
        they are a suffix, and all of it is re-run, in order, before the
        command that failed.  The agent saw those steps' outputs already:
        the re-runs' outputs are not shown again (a different exit status
        is logged).
        """
        sb = self.sandbox
        self.logger.warning("crab sandbox %s died (%s); recovering it from its latest checkpoint", sb.name, cause)
        try:
            got = sb.recover()
        except CrabError as exc:
            raise self._error("recovering the dead sandbox", exc) from exc
        lost = set(got.lost_turns)
        if self._origin.sandbox_id == sb.id and self._origin.turn in lost:
            raise CrabEnvironmentError(f"recovery lost the sandbox's starting state (turn {self._origin.turn})")
        first = next(
            (i for i, s in enumerate(self._steps) if s.sandbox_id == sb.id and s.turn in lost), len(self._steps)
        )
        self._replay_from = first if self._replay_from is None else min(first, self._replay_from)
        replay = tuple(s.step for s in self._steps[self._replay_from :])
        self.recoveries.append(CrabRecovery(got.checkpoint, got.checkpoint_turn, tuple(got.lost_turns), replay, cause))
        self.logger.info("recovered %s from %s; re-running steps %s", sb.name, got.checkpoint, list(replay) or "none")

    def _replay(self) -> None:
        """Re-run, in order, the steps a recovery lost (each as a turn of its own)."""
        while self._replay_from is not None and self._replay_from < len(self._steps):
            old = self._steps[self._replay_from]
            ran = self._turn(old.command, old.timeout or self.config.timeout)
            if ran.output["returncode"] != old.returncode:
                self.logger.warning(
                    "step %d exited %s when re-run after the recovery (%s before)",
                    old.step,
                    ran.output["returncode"],
                    old.returncode,
                )
            self._steps[self._replay_from] = dataclasses.replace(
                old, sandbox_id=self.sandbox.id, turn=ran.turn, checkpoint_id=""
            )
            self._replay_from += 1
        self._replay_from = None


#: Environments whose sandbox is not removed yet: removed at interpreter exit (while gRPC still works).
_LIVE: weakref.WeakSet[CrabEnvironment] = weakref.WeakSet()


@atexit.register
def _cleanup_at_exit() -> None:
    for env in list(_LIVE):
        with contextlib.suppress(Exception):
            env.cleanup()
