"""A simulated crab cluster on this machine: Ray nodes with mutual TLS, one crabd per node, one S3 bucket.

Used by ``tests/integration/test_cluster_ray.py`` and ``bench/cluster_ray.py``.

* one real S3-protocol server process (moto, :class:`tests.s3server.S3Server`),
  whose bucket every crabd uses as its remote tier; the crabds get the
  credentials from the environment only;
* one cluster CA and one certificate per host (:mod:`crabd.cluster.tls`);
* one crabd per host: own state dir, socket, sandbox network, host id, so no
  host can read another's local store;
* ``ray.cluster_utils.Cluster`` with one node per host (``num_cpus`` 1), each
  node's Ray processes started with *that host's* certificate, and the
  ``crab-host:<id>`` resource;
* every host joined: its agent actor on its node, registered.

Ray reads ``RAY_USE_TLS`` and the certificate paths once, when it is first
imported into a process, so :func:`sim_cluster` sets them before its first
``import ray`` and refuses to run if Ray was imported already.  Everything
goes when the context ends, on an error too (the crabds' containers and
networks by ``daemon_with_config``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crabd.cluster import tls
from crabd.cluster.hosts import node_resources
from crabd.sdk import Client, EmbeddedDaemon
from tests.integration.conftest import daemon_with_config
from tests.s3server import S3Server
from tests.trust_keys import trust_each_other

MB = 1024 * 1024
# Small nodes: this machine is small, and nothing large moves through Ray.
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * MB}


class RayImportedTooEarly(RuntimeError):
    """Ray was imported into this process before its TLS settings were in the environment."""


@dataclass
class SimCluster:
    ray_cluster: Any  # ray.cluster_utils.Cluster
    nodes: dict[str, Any]
    daemons: dict[str, EmbeddedDaemon]
    tls_dir: Path
    s3: S3Server
    crab: Any  # crabd.cluster.client.Cluster
    timings: dict[str, float] = field(default_factory=dict)

    def client(self, host: str) -> Client:
        return Client(self.daemons[host].socket)

    def lose(self, host: str) -> None:
        """``host`` dies as a machine would: its Ray node without a drain, its crabd by SIGKILL."""
        self.ray_cluster.remove_node(self.nodes[host], allow_graceful=False)
        self.daemons[host].kill()


@contextlib.contextmanager
def env(values: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def node_ip() -> str:
    """This machine's outbound address (what Ray picks for its nodes), found without importing Ray."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent, only a route is looked up
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _host_toml(s3: S3Server, host: str, net: str, prefix: str) -> str:
    remote = s3.config_toml(prefix, host_id=host, retry_initial_s=0.2, retry_max_s=1.0)
    return f'[network]\nname = "{net}"\n\n' + remote


@contextlib.contextmanager
def sim_cluster(
    hosts: Sequence[str], *, net_prefix: str, bucket: str, capacity: int = 8, prefix: str = "cluster/"
) -> Iterator[SimCluster]:
    """The simulated cluster of ``hosts`` (the first is the head node and the driver's host).

    ``net_prefix`` + host id names each host's sandbox network (at most 10
    characters in all, lower-case letters and digits).
    """
    if "ray._raylet" in sys.modules:
        raise RayImportedTooEarly("Ray was imported before the simulated cluster set its TLS environment")
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(S3Server(bucket=bucket))
        stack.enter_context(env(s3.env))
        tls_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="crab-tls-")))
        tls.init_ca(tls_dir)
        # Ray dials the node's own address; on one machine all the hosts share it.
        addresses = sorted({"127.0.0.1", node_ip()})
        for h in hosts:
            tls.issue_host_cert(tls_dir, h, ips=addresses)
        t0 = time.monotonic()
        daemons = {
            h: stack.enter_context(daemon_with_config(_host_toml(s3, h, net_prefix + h, prefix), net_prefix + h))
            for h in hosts
        }
        t_daemons = time.monotonic() - t0
        # The hosts trust each other's checkpoints (processes included), as the cluster's key material says.
        trust_each_other(daemons.values())
        # The driver (this process) is the first host: Ray is imported only now.
        stack.enter_context(env(tls.ray_tls_env(tls_dir, hosts[0])))
        import ray
        from ray.cluster_utils import Cluster

        t0 = time.monotonic()
        cluster = Cluster(
            initialize_head=True,
            head_node_args={**NODE_ARGS, "resources": node_resources(hosts[0]), "include_dashboard": False},
        )
        stack.callback(cluster.shutdown)
        nodes = {hosts[0]: cluster.head_node}
        for h in hosts[1:]:
            # Each node's Ray processes present their own host's certificate (inherited from os.environ).
            with env(tls.ray_tls_env(tls_dir, h)):
                nodes[h] = cluster.add_node(**NODE_ARGS, resources=node_resources(h))
        cluster.wait_for_nodes()
        stack.callback(ray.shutdown)
        from crabd.cluster.connect import connect, join

        crab = connect(cluster.address)
        t_ray = time.monotonic() - t0
        t0 = time.monotonic()
        for h in hosts:
            join(h, str(daemons[h].socket), capacity=capacity)
        crab.refresh()
        timings = {"crabds_start_s": t_daemons, "ray_start_s": t_ray, "agents_join_s": time.monotonic() - t0}
        yield SimCluster(cluster, nodes, daemons, tls_dir, s3, crab, timings)
