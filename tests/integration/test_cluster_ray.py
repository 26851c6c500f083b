"""crab's Ray cluster layer on a simulated 3-host cluster on this machine.

The cluster is ``tests/simcluster.py``'s: three Ray nodes (1 CPU each, mutual
TLS, each node with its own host certificate), one crabd per node with its own
state dir, socket and network, and one real S3-protocol server process (moto)
whose bucket all three crabds use as their remote tier.  Each host's agent is
a Ray actor pinned to that host's node.  The host-loss tests remove node b,
then node c (and stop their crabds), so they run last.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agents.llm import AsyncChatClient
from agents.rl import OraclePolicy, Rollouts, Trajectory
from agents.tasks import find
from crabd.cluster import tls
from crabd.cluster.hosts import NAMESPACE
from crabd.llm import StandinServer
from crabd.sdk import AsyncClient
from tests.polling import wait_for
from tests.simcluster import RayImportedTooEarly, SimCluster, node_ip, sim_cluster

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.slow]

HOSTS = ("a", "b", "c")
DEAD_WITHIN_S = 30.0
CAPACITY = 4


@pytest.fixture(scope="module")
def sim() -> Iterator[SimCluster]:
    try:
        with sim_cluster(HOSTS, net_prefix="crabcl", bucket="crab-cluster", capacity=CAPACITY) as cluster:
            yield cluster
            print("cluster timings:", {k: round(v, 3) for k, v in cluster.timings.items()})
    except RayImportedTooEarly as exc:
        pytest.fail(str(exc))


def _fetched(sim: SimCluster, host: str) -> int:
    with sim.client(host) as c:
        return int(c.engine_status().stats["remote"]["fetched"])


def test_tls_is_enforced(sim: SimCluster) -> None:
    """The GCS answers a client with a cluster certificate, and no other (another CA's, none, plaintext)."""
    import grpc

    good = tls.host_files(sim.tls_dir, "b")
    rogue_dir = sim.tls_dir / "rogue"
    tls.init_ca(rogue_dir)
    bad = tls.issue_host_cert(rogue_dir, "b", ips=["127.0.0.1", node_ip()])

    def ready(creds: grpc.ChannelCredentials | None) -> bool:
        address = sim.ray_cluster.address
        ch = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(ch).result(timeout=3)
            return True
        except grpc.FutureTimeoutError:
            return False
        finally:
            ch.close()

    ca = good.ca_cert.read_bytes()
    assert ready(grpc.ssl_channel_credentials(ca, good.key.read_bytes(), good.cert.read_bytes()))
    assert not ready(grpc.ssl_channel_credentials(ca, bad.key.read_bytes(), bad.cert.read_bytes()))
    assert not ready(grpc.ssl_channel_credentials(ca))
    assert not ready(None)


def test_each_agent_runs_on_its_own_node_and_owns_its_crabd(sim: SimCluster) -> None:
    hosts = sim.crab.refresh()
    assert {h: (s["alive"], s["capacity"]) for h, s in hosts.items()} == {h: (True, CAPACITY) for h in HOSTS}
    from crabd.cluster.pool import Call

    infos = {h: sim.crab.pool.call(Call(h, "info")) for h in HOSTS}
    assert {h: i["node_id"] for h, i in infos.items()} == {h: sim.nodes[h].node_id for h in HOSTS}
    assert {h: i["crabd_pid"] for h, i in infos.items()} == {h: sim.daemons[h].pid for h in HOSTS}
    for h in HOSTS:
        with sim.client(h) as c:
            assert c.status().host_id == h


def test_fork_of_8_spreads_over_the_hosts_and_each_downloads_the_base_once(sim: SimCluster) -> None:
    crab = sim.crab
    src = crab.create("busybox", name="fan-src", host="a")
    try:
        crab.call("fan-src", "run", "sh -c 'echo base > /tmp/base'")
        ck = crab.call("fan-src", "checkpoint", "base")
        before = {h: _fetched(sim, h) for h in HOSTS}
        t0 = time.monotonic()
        kids = crab.fork(ck["id"], 8, name_prefix="fan")
        sim.timings["fork8_s"] = time.monotonic() - t0
        per_host = {h: sum(1 for k in kids if k["host_id"] == h) for h in HOSTS}
        assert sum(per_host.values()) == 8 and all(n >= 2 for n in per_host.values()), per_host
        # Host a made the checkpoint; b and c each fetched it from the bucket exactly once.
        assert {h: _fetched(sim, h) - before[h] for h in HOSTS} == {"a": 0, "b": 1, "c": 1}
        for k in kids:
            with sim.client(k["host_id"]) as c:
                assert c.get(k["id"]).run("cat /tmp/base").stdout == b"base\n"
    finally:
        for sb in crab.list():
            if sb["name"].startswith("fan"):
                crab.remove(sb["id"])
    assert src["host_id"] == "a"


def test_migrate_moves_a_sandbox_with_its_processes_and_identity(sim: SimCluster) -> None:
    crab = sim.crab
    sb = crab.create("busybox", name="mover", host="a")
    crab.call("mover", "run", "sh -c 'sleep 1000 & echo $! > /tmp/bg; echo kept > /tmp/f'")
    pid = crab.call("mover", "run", "cat /tmp/bg")["stdout"].strip()
    moved = crab.migrate("mover", "b")
    sim.timings["migrate_paused_s"] = moved["paused_s"]
    try:
        assert (moved["sandbox"]["id"], moved["sandbox"]["name"], moved["to"]) == (sb["id"], "mover", "b")
        assert crab.where("mover") == (sb["id"], "b")
        with sim.client("b") as b, sim.client("a") as a:
            there = b.get(sb["id"])
            assert there.run("cat /tmp/f").stdout == b"kept\n"
            assert there.run(f"kill -0 {pid}").exit_code == 0
            # The source copy is gone; its checkpoints stay, for the sandbox's lineage.
            assert sb["id"] not in {s.id for s in a.list()}
            assert moved["checkpoint"] in {k.id for k in a.checkpoints()}
    finally:
        crab.remove("mover")


KV = find("shell/kv-server")  # its server, started at turn 1, must live on in every branch (a process checkpoint)
KV_STEPS = 3 * len(KV.turns) + 5


def _leaves(trajs: list[Trajectory]) -> list[tuple[str, float, int, int, bool]]:
    return sorted((t.id, t.reward, len(t.steps), t.generated_tokens, t.solved) for t in trajs)


def _workers(sim: SimCluster, url: str) -> dict[str, Any]:
    from agents.rl.cluster import OracleFactory, start_workers

    return start_workers({h: str(sim.daemons[h].socket) for h in HOSTS}, OracleFactory(url, (KV,), explore=0.0), [KV])


def test_rollouts_spread_over_the_hosts_give_what_one_host_gives(sim: SimCluster) -> None:
    import ray

    from agents.rl.cluster import ClusterRollouts

    with StandinServer(time_scale=0.02) as srv:
        url = f"{srv.url}/v1"
        workers = _workers(sim, url)

        async def go() -> tuple[ClusterRollouts, list[Trajectory], list[Trajectory]]:
            async with ClusterRollouts(workers, max_steps=KV_STEPS) as cro:
                spread = await cro.group(KV, prefix_steps=2, k=3, seed=5)
            async with AsyncClient(sim.daemons["a"].socket) as client, AsyncChatClient(url) as llm:
                one = Rollouts(client, OraclePolicy(llm, {KV.name: KV}, explore=0.0), max_steps=KV_STEPS)
                return cro, spread, await one.group(KV, prefix_steps=2, k=3, seed=5)

        try:
            cro, spread, one_host = asyncio.run(go())
        finally:
            for w in workers.values():
                ray.kill(w)
    # The same trajectories (ids, rewards, steps, tokens): where a branch ran changes nothing.
    assert _leaves(spread) == _leaves(one_host)
    assert all(t.solved for t in spread)
    assert len(set(cro.hosts_of.values())) >= 2, cro.hosts_of
    assert cro.ledger.forks == 2 and cro.ledger.recoveries == 0
    for h in HOSTS:
        with sim.client(h) as c:
            assert not [s.name for s in c.list() if s.name.startswith("rl-")]


def test_rollouts_go_on_when_a_host_is_lost(sim: SimCluster) -> None:
    import ray

    from agents.rl.cluster import ClusterRollouts

    out: dict[str, Any] = {}
    with StandinServer(time_scale=0.05) as srv:
        workers = _workers(sim, f"{srv.url}/v1")

        def rollout() -> None:
            async def go() -> None:
                async with ClusterRollouts(workers, max_steps=KV_STEPS) as cro:
                    out["cro"] = cro
                    out["leaves"] = await cro.group(KV, prefix_steps=1, k=3, seed=7)

            try:
                asyncio.run(go())
            except BaseException as exc:  # reported by the assertions below
                out["error"] = exc

        runner = threading.Thread(target=rollout)
        runner.start()
        with sim.client("b") as b:
            # Host b is lost while a branch runs on it (the driver placed one there).
            wait_for("a branch on host b", lambda: any(s.name.startswith("rl-") for s in b.list()), 60)
        sim.lose("b")
        runner.join(timeout=300)
        for h in ("a", "c"):
            ray.kill(workers[h])
    assert not runner.is_alive() and "error" not in out, out.get("error")
    cro, leaves = out["cro"], out["leaves"]
    assert len(leaves) == 3 and all(t.solved for t in leaves), [t.to_json() for t in leaves]
    assert cro.dead == {"b"} and cro.ledger.recoveries == 1
    assert "b" not in cro.hosts_of.values()


def test_a_lost_host_s_sandboxes_come_back_on_the_others(sim: SimCluster) -> None:
    crab = sim.crab
    sb = crab.create("busybox", name="survivor", host="c")
    crab.call("survivor", "run", "sh -c 'echo one > /tmp/state'")
    ck = crab.call("survivor", "checkpoint", "kept")
    with sim.client("c") as c:
        c.push(ck["id"])
    crab.registry.note_turn(sb["id"], ck["turn"] + 1)  # one more turn ended that never became remote

    t0 = time.monotonic()
    # As a crash would: no graceful drain; the host's crabd goes with it.
    sim.lose("c")
    # (Host b was lost in the test before: the registry learns it here too.)
    wait_for("host c to be seen dead", lambda: "c" in crab.check(), DEAD_WITHIN_S)
    sim.timings["host_dead_after_s"] = time.monotonic() - t0
    report = crab.recover_host("c")
    sim.timings["host_recovered_after_s"] = time.monotonic() - t0
    (got,) = report["recovered"]
    assert report["unrecoverable"] == {}
    assert got["sandbox"]["id"] == sb["id"] and got["checkpoint"] == ck["id"] and got["host"] in {"a", "b"}
    assert got["lost_turns"] == [ck["turn"] + 1]
    with sim.client(got["host"]) as c:
        assert c.get(sb["id"]).run("cat /tmp/state").stdout == b"one\n"
    assert crab.registry.hosts()["c"]["alive"] is False
    crab.remove("survivor")
    import ray

    assert ray.get_runtime_context().namespace == NAMESPACE
