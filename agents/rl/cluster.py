"""Group and tree rollouts over a cluster of crab hosts (Ray), surviving the loss of a host.

Each host runs one :class:`RolloutWorker` (a Ray actor pinned to the host's
node, like its :class:`~crabd.cluster.hosts.HostAgent`) that runs *lines* of
rollouts in sandboxes of its own crabd, with the single-host
:class:`~agents.rl.rollout.Rollouts`.  The driver, :class:`ClusterRollouts`,
holds the trajectories and the tree:

1. a line starts on the least-loaded live host and runs until the next
   branch point (or its end);
2. there the worker snapshots its environment and pushes the checkpoint to
   the bucket (so any host can fork it), and keeps the environment open;
3. the line's own continuation goes on in that environment; the other
   branches are forked on the least-loaded hosts, each fetching the snapshot
   from the bucket once; every branch runs to the next branch point;
4. when a host is lost (its worker's actor dies, or its crabd stops
   answering), each line that was running
   there starts again on a live host from the line's last snapshot, with
   the trajectory as it was at that snapshot (the steps after it are redone
   and counted in ``Trajectory.redone_steps``), or from reset when the line
   had no snapshot yet.  The ledger counts these in ``recoveries``.

Everything but the Ray calls is plain asyncio, so the driver's logic is
tested with in-process workers (``workers`` of plain objects, ``ray=False``).
Ray is imported only where an actor is made or called: single-host rollouts
(``agents.rl.Rollouts``) never need it.
"""

from __future__ import annotations

import copy
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agents.llm import AsyncChatClient
from agents.rl.env import CrabEnv, Snapshot
from agents.rl.policy import OraclePolicy, Policy
from agents.rl.rollout import Rollouts, TreeBudget, _child_seed, _Spend, together
from agents.rl.trajectory import Ledger, Trajectory
from agents.tasks import Task
from crabd.errors import CrabError, DaemonUnavailable, HostUnavailable
from crabd.sdk import AsyncClient

log = logging.getLogger("agents.rl.cluster")


@dataclass
class LineResult:
    """Where a line stands after a worker ran it: its trajectory, and (at a branch point) its open env."""

    traj: Trajectory
    host: str
    #: The worker's open environment for this line ("" once the line is done and its env closed).
    token: str = ""
    #: The line's state at the branch point it stopped at (pushed to the bucket).
    snapshot: Snapshot | None = None
    ledger: dict[str, int] | None = None


@dataclass(frozen=True)
class OracleFactory:
    """Makes the oracle policy inside a worker.

    A policy holds an HTTP client bound to one event loop, so it cannot be
    shipped to another process; this (a URL and the tasks) can.
    """

    llm_url: str
    tasks: tuple[Task, ...]
    explore: float = 0.15
    slip: float = 0.0

    def __call__(self) -> Policy:
        llm = AsyncChatClient(self.llm_url)
        return OraclePolicy(llm, {t.name: t for t in self.tasks}, explore=self.explore, slip=self.slip)


class RolloutWorker:
    """Runs lines of rollouts on one host's crabd (a Ray actor; see :func:`start_workers`)."""

    def __init__(
        self, host_id: str, socket_path: str, make_policy: Callable[[], Policy], tasks: Sequence[Task]
    ) -> None:
        self.host_id = host_id
        self.socket_path = socket_path
        self.make_policy = make_policy
        self.tasks = {t.name: t for t in tasks}
        self._client: AsyncClient | None = None
        self._policy: Policy | None = None
        self._envs: dict[str, CrabEnv] = {}

    def _rollouts(self, max_steps: int) -> Rollouts:
        # Made on first use, inside the actor's event loop (the policy's HTTP client lives there).
        if self._client is None or self._policy is None:
            self._client = AsyncClient(self.socket_path)
            self._policy = self.make_policy()
        return Rollouts(self._client, self._policy, max_steps=max_steps)

    async def start_line(
        self, task: str, seed: int, traj_id: str, group: str, until: int | None, max_steps: int, checkpoints: str
    ) -> LineResult:
        """Reset a fresh environment for ``task`` and run it to step ``until`` (None: to its end)."""
        ro = self._rollouts(max_steps)
        env = ro.env(self.tasks[task], checkpoints=checkpoints, name=f"rl-{secrets.token_hex(4)}")
        try:
            traj = await ro.start(env, traj_id, seed, group)
            return await self._run(ro, env, traj, until)
        except BaseException:
            await env.close()
            raise

    async def fork_line(self, snap: Snapshot, traj: Trajectory, until: int | None, max_steps: int) -> LineResult:
        """Fork ``snap`` here (fetched from the bucket if this host lacks it) and run ``traj`` on in it."""
        ro = self._rollouts(max_steps)
        assert self._client is not None
        (sb,) = await self._client.fork(snap.checkpoint_id, 1, name_prefix=f"rl-{secrets.token_hex(4)}")
        env = ro.env(self.tasks[snap.task]).branch_into(sb, snap)
        ro.ledger.forks += 1
        try:
            return await self._run(ro, env, traj, until)
        except BaseException:
            await env.close()
            raise

    async def resume_line(self, token: str, traj: Trajectory, until: int | None, max_steps: int) -> LineResult:
        """Run ``traj`` on in the environment this worker kept at a branch point."""
        env = self._envs.pop(token)
        ro = self._rollouts(max_steps)
        try:
            return await self._run(ro, env, traj, until)
        except BaseException:
            await env.close()
            raise

    async def close_line(self, token: str) -> None:
        env = self._envs.pop(token, None)
        if env is not None:
            await env.close()

    async def close_all(self) -> int:
        """Close every environment kept at a branch point (a driver gave up on its rollouts); how many."""
        envs, self._envs = list(self._envs.values()), {}
        for env in envs:
            await env.close()
        return len(envs)

    async def _run(self, ro: Rollouts, env: CrabEnv, traj: Trajectory, until: int | None) -> LineResult:
        await ro.finish(env, traj, until=until)
        if traj.done or until is None:
            await env.close()
            return LineResult(traj, self.host_id, ledger=ro.ledger.to_json())
        snap = await env.snapshot()
        ro.ledger.snapshots += 1
        assert self._client is not None
        await self._client.push(snap.checkpoint_id)  # any host may fork it now
        token = secrets.token_hex(6)
        self._envs[token] = env
        return LineResult(traj, self.host_id, token, snap, ro.ledger.to_json())


def start_workers(hosts: Mapping[str, str], make_policy: Callable[[], Policy], tasks: Sequence[Task]) -> dict[str, Any]:
    """One :class:`RolloutWorker` actor per host (``hosts``: host id -> its crabd socket); their handles."""
    import ray

    from crabd.cluster.hosts import host_resource

    cls = ray.remote(RolloutWorker)
    return {
        h: cls.options(
            num_cpus=0,
            resources={host_resource(h): 1},
            # Node-bound, like the host's agent: never restarted elsewhere; its death is the host's loss.
            max_restarts=0,
            max_concurrency=64,
        ).remote(h, socket, make_policy, list(tasks))
        for h, socket in hosts.items()
    }


class ClusterRollouts:
    """Rollouts whose lines run on the workers of several hosts; see the module docstring."""

    def __init__(self, workers: Mapping[str, Any], *, max_steps: int = 30, ray: bool = True) -> None:
        self.workers = dict(workers)
        self.max_steps = max_steps
        self.ray = ray
        self.ledger = Ledger()
        self.dead: set[str] = set()
        self._running: dict[str, int] = dict.fromkeys(self.workers, 0)
        #: Which host ran each final trajectory (by trajectory id).
        self.hosts_of: dict[str, str] = {}

    async def aclose(self) -> None:
        """Close what the live workers kept open for lines that a failed rollout left behind."""
        for h in self.workers:
            if h not in self.dead:
                try:
                    await self._call(h, "close_all")
                except CrabError as exc:
                    log.warning("host %s: kept environments not closed: %s", h, exc)

    async def __aenter__(self) -> ClusterRollouts:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- strategies -------------------------------------------------------------------

    async def from_reset(self, task: Task, k: int, *, seed: int) -> list[Trajectory]:
        """``k`` episodes from reset, spread over the hosts (no checkpoints, as the baseline)."""
        group = f"{task.id}-{seed}"
        lines = await together(
            self._line(task, None, None, until=None, start=(seed + i, f"{group}/r{i}", group), checkpoints="none")
            for i in range(k)
        )
        return [self._final(r) for r in lines]

    async def group(self, task: Task, *, prefix_steps: int, k: int, seed: int) -> list[Trajectory]:
        return await self.tree(task, branch_at=(prefix_steps,), width=k, seed=seed, budget=TreeBudget(k, k))

    async def tree(
        self, task: Task, *, branch_at: Sequence[int], width: int, seed: int, budget: TreeBudget | None = None
    ) -> list[Trajectory]:
        """Like :meth:`Rollouts.tree`, with branches spread over the hosts."""
        points = sorted(set(branch_at))
        if width < 1 or (points and points[0] < 0):
            raise ValueError("width must be at least 1 and branch points non-negative")
        spend = _Spend(budget or TreeBudget())
        group = f"{task.id}-{seed}"
        first = await self._line(task, None, None, until=_next(points, 0), start=(seed, f"{group}/t", group))
        return await self._grow(task, first, points, width, spend)

    async def _grow(
        self, task: Task, line: LineResult, points: list[int], width: int, spend: _Spend
    ) -> list[Trajectory]:
        """At a branch point: the line goes on in its own env, the other branches forked over the hosts."""
        traj = line.traj
        if traj.done or line.snapshot is None:
            return [self._final(line)]
        until = _next(points, sum(1 for p in points if p <= len(traj.steps)))
        extra = spend.take(width - 1)
        if extra == 0:  # the budget is spent: this line goes on unbranched, as Rollouts.tree does
            kids = [traj]
        else:
            kids = [traj.branch(f"{traj.id}.{i}", _child_seed(traj.seed, len(traj.steps), i)) for i in range(extra + 1)]
        own = self._line(task, line.snapshot, kids[0], until=until, token=line.token, host=line.host)
        runs = [own, *(self._line(task, line.snapshot, kid, until=until) for kid in kids[1:])]
        grown = await together(self._branch(task, run, points, width, spend) for run in runs)
        return [leaf for leaves in grown for leaf in leaves]

    async def _branch(
        self, task: Task, run: Awaitable[LineResult], points: list[int], width: int, spend: _Spend
    ) -> list[Trajectory]:
        return await self._grow(task, await run, points, width, spend)

    def _final(self, line: LineResult) -> Trajectory:
        self.hosts_of[line.traj.id] = line.host
        return line.traj

    # --- one line on some host, surviving host loss --------------------------------------

    async def _line(
        self,
        task: Task,
        snap: Snapshot | None,
        traj: Trajectory | None,
        *,
        until: int | None,
        start: tuple[int, str, str] | None = None,
        token: str = "",
        host: str = "",
        checkpoints: str = "auto",
    ) -> LineResult:
        """Run one line to ``until``: on in ``token``'s env on ``host``, forked from ``snap``, or from reset.

        When the host is lost the line runs again on a live host: from
        ``snap`` with ``traj`` as it was there, or from reset without one.
        """
        saved = copy.deepcopy(traj)
        while True:
            target = host if token else self._pick()
            self._running[target] += 1
            try:
                if token:
                    got = await self._call(target, "resume_line", token, copy.deepcopy(saved), until, self.max_steps)
                elif snap is not None:
                    got = await self._call(target, "fork_line", snap, copy.deepcopy(saved), until, self.max_steps)
                else:
                    assert start is not None
                    seed, traj_id, group = start
                    got = await self._call(
                        target, "start_line", task.name, seed, traj_id, group, until, self.max_steps, checkpoints
                    )
            except (HostUnavailable, DaemonUnavailable) as exc:
                # A worker whose crabd stopped answering has lost its sandboxes for this rollout's
                # purposes as surely as one whose node died: the line goes on elsewhere.
                if isinstance(exc, HostUnavailable) and not exc.gone:
                    raise
                self._lost(target, exc)
                token = ""  # the kept environment went with the host
                continue
            finally:
                self._running[target] -= 1
            result: LineResult = got
            self._add(result.ledger)
            return result

    async def _call(self, host: str, method: str, *args: Any) -> Any:
        worker = self.workers[host]
        if not self.ray:
            return await getattr(worker, method)(*args)
        from ray import exceptions as rex

        try:
            result = await getattr(worker, method).remote(*args)
        except rex.RayTaskError as exc:
            if isinstance(exc.cause, CrabError):
                raise exc.cause from exc
            raise
        except (rex.RayActorError, rex.NodeDiedError) as exc:
            lost = host_lost(host, exc)
            if lost is None:
                raise
            raise lost from exc
        return result

    def _pick(self) -> str:
        live = [h for h in self.workers if h not in self.dead]
        if not live:
            raise HostUnavailable("every host of the rollout is lost", host=",".join(sorted(self.workers)), gone=True)
        return min(live, key=lambda h: (self._running[h], h))

    def _lost(self, host: str, exc: CrabError) -> None:
        if host not in self.dead:
            log.warning("host %s lost during rollouts (%s); its lines go on elsewhere", host, exc.message)
        self.dead.add(host)
        self.ledger.recoveries += 1

    def _add(self, ledger: Mapping[str, int] | None) -> None:
        for k, v in (ledger or {}).items():
            setattr(self.ledger, k, getattr(self.ledger, k) + v)


def host_lost(host: str, exc: BaseException) -> HostUnavailable | None:
    """The rollout's view of a Ray failure of ``host``'s worker: lost to this rollout, or None (not a host failure).

    Dead (``ActorDiedError``, ``NodeDiedError``): lost.  Unreachable
    (``ActorUnavailableError``: Ray could not connect to the worker's node,
    which it reports until it has noticed that the node died, seconds later)
    is lost too, as a crabd that stopped answering is: the line goes on
    elsewhere from its checkpoint, and whatever the host still does for it
    is not waited for.  A call that reached the worker may have run there,
    so it is not tried again on that host.
    """
    from ray import exceptions as rex

    if isinstance(exc, (rex.ActorDiedError, rex.NodeDiedError)):
        return HostUnavailable(f"the rollout worker of host {host!r} died: {exc}", host=host, gone=True)
    if isinstance(exc, rex.ActorUnavailableError):
        return HostUnavailable(f"the rollout worker of host {host!r} is unreachable: {exc}", host=host, gone=True)
    return None


def _next(points: list[int], depth: int) -> int | None:
    return points[depth] if depth < len(points) else None
