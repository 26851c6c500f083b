"""The cluster layer's logic (fork fan-out, migration, host-loss recovery) over in-memory hosts.

The same operations run on a real 3-node Ray cluster with three crabds in
``tests/integration/test_cluster_ray.py``; these pin the orders and the
undo paths that are hard to provoke there.
"""

from __future__ import annotations

import pytest

from crabd.errors import HostUnavailable, InvalidRequest, MigrationFailed, NoCapacity, SandboxNotFound
from tests.fake_cluster import fake_cluster


def test_refresh_rebuilds_the_registry_from_the_hosts() -> None:
    cluster, _pool, fakes = fake_cluster()
    fakes["b"].new_sandbox("existing", turn=3)
    hosts = cluster.refresh()
    assert {h: s["load"] for h, s in hosts.items()} == {"a": 0, "b": 1, "c": 0}
    sid, host = cluster.where("existing")
    assert host == "b" and cluster.registry.placed(sid) == {"host": "b", "name": "existing", "turn": 3}


def test_create_goes_to_the_least_loaded_live_host() -> None:
    cluster, pool, fakes = fake_cluster()
    fakes["a"].new_sandbox("x")
    cluster.refresh()
    first = cluster.create("busybox", name="one")
    second = cluster.create("busybox", name="two")
    assert (first["host_id"], second["host_id"]) == ("b", "c")
    pool.down.add("b")
    assert cluster.check() == ["b"]
    assert cluster.create("busybox", name="three")["host_id"] in {"a", "c"}


def test_fork_spreads_over_hosts_and_each_fetches_the_base_once() -> None:
    cluster, _pool, fakes = fake_cluster(capacity=4)
    src = cluster.create("busybox", name="src")
    cluster.call("src", "run", "f=1")
    ck = cluster.call("src", "checkpoint_full", "base")
    kids = cluster.fork(ck["id"], 8, name_prefix="g")
    per_host = {h: sum(1 for k in kids if k["host_id"] == h) for h in "abc"}
    assert sum(per_host.values()) == 8 and max(per_host.values()) - min(per_host.values()) <= 2
    # The holder pushed it first; the others fetched it once each, whatever their share.
    holder = src["host_id"]
    assert ck["id"] in fakes[holder].bucket.checkpoints
    assert fakes[holder].fetches == []
    assert all(fakes[h].fetches == [ck["id"]] for h in "abc" if h != holder)
    names = [k["name"] for k in kids]
    assert len(set(names)) == 8 and all(n.startswith(f"g-{k['host_id']}-") for n, k in zip(names, kids, strict=True))
    assert {cluster.registry.host_of(k["id"]) for k in kids} == {k["host_id"] for k in kids}


def test_a_fork_that_fails_on_one_host_leaves_no_child_anywhere() -> None:
    cluster, _pool, fakes = fake_cluster(capacity=4)
    cluster.create("busybox", name="src", host="a")
    ck = cluster.call("src", "checkpoint_full")
    fakes["c"].fail["fork"] = InvalidRequest("no room on c")
    with pytest.raises(InvalidRequest, match="no room on c"):
        cluster.fork(ck["id"], 6)
    assert [len(fakes[h].sandboxes) for h in "abc"] == [1, 0, 0]
    assert cluster.registry.hosts()["b"]["load"] == 0


def test_fork_beyond_the_free_capacity_is_refused_before_anything_moves() -> None:
    cluster, _pool, fakes = fake_cluster(capacity=2)
    cluster.create("busybox", name="src", host="a")
    ck = cluster.call("src", "checkpoint_full")
    with pytest.raises(NoCapacity) as err:
        cluster.fork(ck["id"], 6)
    assert (err.value.requested, err.value.free) == (6, 5)
    assert all(f.calls.count("fork") == 0 and f.calls.count("push") == 0 for f in fakes.values())


def test_migrate_keeps_identity_and_removes_the_source_only_after_the_target_runs() -> None:
    cluster, _pool, fakes = fake_cluster()
    sb = cluster.create("busybox", name="mover", host="a")
    cluster.call("mover", "run", "note=hello")
    moved = cluster.migrate("mover", "c")
    assert (moved["sandbox"]["id"], moved["sandbox"]["name"], moved["from"], moved["to"]) == (
        sb["id"],
        "mover",
        "a",
        "c",
    )
    assert fakes["c"].sandboxes[sb["id"]]["files"] == {"note": "hello"}
    assert fakes["c"].sandboxes[sb["id"]]["state"] == "running"
    assert sb["id"] not in fakes["a"].sandboxes
    assert cluster.where("mover") == (sb["id"], "c")
    assert fakes["a"].calls[-4:] == ["checkpoint_full", "stop", "push", "remove"]
    assert moved["paused_s"] >= moved["import_s"] >= 0


def test_a_failed_import_leaves_the_sandbox_running_on_its_source() -> None:
    cluster, _pool, fakes = fake_cluster()
    sb = cluster.create("busybox", name="stay", host="a")
    cluster.call("stay", "run", "x=1")
    fakes["b"].fail["import_sandbox"] = HostUnavailable("b went away", host="b", gone=True)
    with pytest.raises(MigrationFailed) as err:
        cluster.migrate("stay", "b")
    assert err.value.source_kept and err.value.target == "b"
    assert fakes["a"].sandboxes[sb["id"]]["state"] == "running"
    assert fakes["a"].sandboxes[sb["id"]]["files"] == {"x": "1"}
    assert sb["id"] not in fakes["b"].sandboxes
    assert cluster.where("stay") == (sb["id"], "a")


def test_migrate_to_a_dead_or_same_host_changes_nothing() -> None:
    cluster, pool, fakes = fake_cluster()
    cluster.create("busybox", name="s", host="a")
    pool.down.add("c")
    cluster.check()
    with pytest.raises(HostUnavailable):
        cluster.migrate("s", "c")
    with pytest.raises(InvalidRequest, match="already"):
        cluster.migrate("s", "a")
    with pytest.raises(InvalidRequest, match="no host"):
        cluster.migrate("nope", "b")
    assert fakes["a"].calls.count("checkpoint_full") == 0


def test_a_lost_hosts_sandboxes_come_back_from_their_newest_remote_checkpoint() -> None:
    cluster, pool, fakes = fake_cluster()
    kept = cluster.create("busybox", name="kept", host="c")
    never = cluster.create("busybox", name="never-pushed", host="c")
    cluster.call("kept", "run", "v=1")
    old = cluster.call("kept", "checkpoint_full")
    fakes["c"].push(old["id"])
    cluster.call("kept", "run", "v=2")
    new = cluster.call("kept", "checkpoint_full")
    fakes["c"].push(new["id"])
    cluster.step("kept", "v=3")  # turn 3: never remote (step tells the registry the turn)
    cluster.call("never-pushed", "run", "w=1")
    pool.down.add("c")

    assert cluster.check() == ["c"]
    report = cluster.recover_host("c")
    (got,) = report["recovered"]
    assert got["sandbox"]["id"] == kept["id"] and got["checkpoint"] == new["id"]
    assert got["lost_turns"] == [3] and got["host"] in {"a", "b"} and got["from_host"] == "c"
    assert fakes[got["host"]].sandboxes[kept["id"]]["files"] == {"v": "2"}
    assert report["unrecoverable"] == {never["id"]: "no remote checkpoint of it"}
    assert cluster.where("kept") == (kept["id"], got["host"])
    # Nothing is placed on the dead host afterwards.
    assert all(cluster.create("busybox")["host_id"] != "c" for _ in range(3))


def test_calls_on_a_sandbox_go_to_its_host() -> None:
    cluster, _pool, fakes = fake_cluster()
    cluster.create("busybox", name="here", host="b")
    cluster.call("here", "run", "k=v")
    assert fakes["b"].sandboxes[cluster.where("here")[0]]["files"] == {"k": "v"}
    cluster.remove("here")
    assert fakes["b"].sandboxes == {}
    with pytest.raises(InvalidRequest):
        cluster.where("here")
    with pytest.raises(SandboxNotFound):
        fakes["b"].run("here", "x=1")
