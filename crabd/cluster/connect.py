"""Joining and reaching a running Ray cluster: the one place that wires the Ray backends together.

``ray.init`` is called here only if the process is not connected yet, with
the crab namespace (named actors live there).  TLS between Ray's processes is
Ray's own (``RAY_USE_TLS`` and the certificate paths in the environment
*before* ``ray`` is imported: Ray reads them once, when it loads); see
``docs/cluster.md``.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, cast

from crabd.cluster.client import Cluster
from crabd.cluster.hosts import NAMESPACE, start_host_agent
from crabd.cluster.pool import RayPool
from crabd.cluster.registry import Registry, RegistryProxy, start_registry
from crabd.errors import HostUnavailable, InvalidRequest

#: Seconds to wait for the cluster's GCS port before calling Ray (which retries for minutes).
REACH_TIMEOUT_S = 5.0


def _reachable(address: str) -> None:
    """HostUnavailable unless ``address`` (``host:port``) accepts a TCP connection within REACH_TIMEOUT_S.

    ``ray.init`` at an address where nothing listens retries for minutes
    before it fails; an operator's typo should fail in seconds.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidRequest(f"cluster address {address!r} is not HOST:PORT (or 'auto')")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        raise HostUnavailable(
            f"cannot reach the Ray cluster at {address}: {exc}",
            host=address,
            hint="Check the address (the head node's GCS port, 6379 by default) and that Ray runs there.",
        ) from exc


def _init(address: str) -> None:
    import ray

    if not ray.is_initialized():
        if address != "auto":
            _reachable(address)
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)


def connect(address: str = "auto") -> Cluster:
    """The cluster at ``address`` (a Ray GCS address, or "auto": the local node's cluster)."""
    _init(address)
    return Cluster(RayPool(), cast(Registry, RegistryProxy(start_registry())))


def join(host_id: str, socket_path: str, *, capacity: int, address: str = "auto") -> dict[str, Any]:
    """Make this host's crabd part of the cluster: start its agent on this node, register it; its info.

    The Ray node this runs on must carry the host's resource
    (``ray start ... --resources '{"crab-host:<id>": 1000}'``, see
    :func:`crabd.cluster.hosts.node_resources`), or the agent cannot be placed.
    """
    import ray

    _init(address)
    agent = start_host_agent(host_id, socket_path, capacity=capacity)
    info: dict[str, Any] = ray.get(agent.info.remote())
    RegistryProxy(start_registry()).add_host(host_id, capacity)
    return info
