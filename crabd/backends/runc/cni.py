"""Networking for runc sandboxes through the standard CNI plugins, invoked directly (no libcni).

The network (a CNI "conflist", kept in memory and written to
``<cache>/<name>.conflist`` for people and ``crabctl doctor``):

1. ``bridge``: Linux bridge ``<name>0`` (distinct from the Docker backend's
   ``crab0``), the bridge as gateway, masquerading to the outside world;
   ``host-local`` IPAM over :attr:`CniSettings.subnet`, its leases in
   ``<cache>/ipam`` (host-local keeps them across reboots; DEL releases them).
2. ``firewall`` (iptables backend): accepts the sandbox's routed traffic
   even though Docker's FORWARD policy is DROP, after running the chain
   ``CNI-ADMIN``, which the plugin keeps for administrators' rules.

Isolation is the Docker backend's (crabd/backends/network.py, with this
network's name): ``<NAME>-SANDBOX-IN`` hooked from ``INPUT -i <bridge>``
keeps sandboxes off the host's own addresses (crabd's sockets included),
and ``<NAME>-SANDBOX-FWD`` hooked from ``CNI-ADMIN -i <bridge>`` rejects
traffic from one sandbox to another and to ``[network] deny``, before the
firewall plugin's per-address accepts.  br_netfilter must be on (bridged
traffic between two sandboxes is otherwise never seen by iptables).

Invocation follows the CNI spec (1.0): each plugin is executed with
``CNI_COMMAND`` / ``CNI_CONTAINERID`` / ``CNI_NETNS`` / ``CNI_IFNAME`` /
``CNI_PATH`` and its own config on stdin (the list's ``cniVersion`` and
``name`` added); on ADD each plugin after the first gets the previous one's
result as ``prevResult``; DEL runs the plugins in reverse with the cached
ADD result as ``prevResult`` and is idempotent; CHECK runs them in order
with the cached result.  The final ADD result is cached in
``<cache>/results/<id>.json`` (DEL and CHECK need it, also after a crabd
restart).

An attachment made ahead of demand for a network slot (:mod:`.slots`) is
ADDed under the slot's id and handed to a container later: the plugins key
what they hold by ``CNI_CONTAINERID`` (host-local's lease, the bridge's
masquerading chain), so that id stays the attachment's for good.  The
hand-over writes ``<cache>/claims/<container id>`` (the slot's id) first and
then renames the result to the container's; DEL and CHECK of the container
go by the claimed id (:meth:`CniNetwork.cni_id`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from crabd.backends import network
from crabd.backends.runc import bundle
from crabd.config import NetworkConfig
from crabd.errors import CommandError, ContainerRuntimeError
from crabd.util import proc
from crabd.util.private_dirs import private_dir
from crabd.util.smallfiles import read_small

CNI_VERSION = "1.0.0"
DEFAULT_PLUGIN_DIR = Path("/usr/lib/cni")
DEFAULT_CACHE_DIR = Path("/var/lib/crab/cni")
#: The chain the firewall plugin runs before its own accepts (its default name).
ADMIN_CHAIN = "CNI-ADMIN"
IFNAME = "eth0"
_PLUGIN_TIMEOUT_S = 60.0
#: How long after :meth:`CniNetwork.ensure` found the host side in place a create trusts it without a look.
RECHECK_S = 2.0


class CniCommand(StrEnum):
    ADD = "ADD"
    DEL = "DEL"
    CHECK = "CHECK"


@dataclass(frozen=True)
class CniSettings:
    """The CNI network of runc sandboxes.  ``net.name`` names the bridge (``<name>0``) and the chains."""

    net: NetworkConfig = field(default_factory=lambda: NetworkConfig(name="crabr"))
    subnet: str = "10.213.0.0/16"
    plugin_dir: Path = DEFAULT_PLUGIN_DIR
    cache_dir: Path = DEFAULT_CACHE_DIR

    @property
    def name(self) -> str:
        return network.network_name(self.net)

    @property
    def bridge(self) -> str:
        return network.bridge_name(self.net)

    def result_path(self, container_id: str) -> Path:
        return self.cache_dir / "results" / f"{container_id}.json"

    def claim_path(self, container_id: str) -> Path:
        """``<cache>/claims/<id>``: the CNI id a container's attachment was made under (a network slot's, slots.py)."""
        return self.cache_dir / "claims" / container_id


def conflist(settings: CniSettings) -> dict[str, Any]:
    """The network's configuration list (see the module's docstring)."""
    ipam = {
        "type": "host-local",
        "ranges": [[{"subnet": settings.subnet}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": str(settings.cache_dir / "ipam"),
    }
    bridge = {
        "type": "bridge",
        "bridge": settings.bridge,
        "isGateway": True,
        "ipMasq": True,
        "hairpinMode": False,
        "ipam": ipam,
    }
    return {
        "cniVersion": CNI_VERSION,
        "name": settings.name,
        "plugins": [bridge, {"type": "firewall", "backend": "iptables"}],
    }


@dataclass(frozen=True)
class CniResult:
    """What ADD reports for the sandbox's interface."""

    address: ipaddress.IPv4Interface
    gateway: ipaddress.IPv4Address | None
    mac: str
    interface: str
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def ip(self) -> ipaddress.IPv4Address:
        return self.address.ip

    @classmethod
    def parse(cls, data: dict[str, Any]) -> CniResult:
        """Parse a CNI 1.0 result: its first IPv4 address, and the interface (in the sandbox) it is on."""
        try:
            interfaces = list(data.get("interfaces") or [])
            for ip in data.get("ips") or []:
                addr = ipaddress.ip_interface(str(ip["address"]))
                if not isinstance(addr, ipaddress.IPv4Interface):
                    continue
                idx = ip.get("interface")
                iface = interfaces[int(idx)] if idx is not None and int(idx) < len(interfaces) else {}
                gw = ip.get("gateway")
                return cls(
                    address=addr,
                    gateway=ipaddress.IPv4Address(str(gw)) if gw else None,
                    mac=str(iface.get("mac") or ""),
                    interface=str(iface.get("name") or ""),
                    raw=data,
                )
        except (KeyError, ValueError, TypeError) as exc:
            raise ContainerRuntimeError(f"malformed CNI result: {exc}: {data!r:.300}", container="") from exc
        raise ContainerRuntimeError(f"the CNI result has no IPv4 address: {data!r:.300}", container="")


def _plugin_error(text: str) -> str:
    """A plugin's error: the spec's JSON ``{"code", "msg", "details"}`` on stdout, or whatever it printed."""
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(data, dict) and "msg" in data:
        details = f" ({data['details']})" if data.get("details") else ""
        return f"{data['msg']}{details} [code {data.get('code')}]"
    return text.strip()


def _iptables(*args: str) -> proc.Completed:
    return proc.run(["iptables", "-w", *args], timeout=_PLUGIN_TIMEOUT_S, check=False)


class CniNetwork:
    """The runc sandboxes' network: :meth:`ensure` once, then :meth:`add` / :meth:`delete` per sandbox."""

    def __init__(self, settings: CniSettings | None = None) -> None:
        self.settings = settings or CniSettings()
        self._lock = threading.Lock()
        #: When :meth:`ensure` last found everything in place (monotonic; None: never, or torn down since).
        self._checked_at: float | None = None

    # --- host side: firewall rules ---------------------------------------------

    def ensure(self) -> None:
        """Check br_netfilter, write the conflist, install the isolation rules (idempotent; repairs lost rules).

        A create calls it each time; the check itself runs at most once per
        RECHECK_S.  It is four iptables runs, serialized by the lock and by
        iptables' own, and the creates of a fork of 8 queued behind them (py-spy:
        9% of the fork's samples).  Rules lost meanwhile (a firewall reload) are
        put back at the first create after RECHECK_S; before this limit they were
        put back at the next create, so the limit adds at most RECHECK_S to a
        window that already lasted until some create came.
        """
        with self._lock:
            if self._checked_at is not None and time.monotonic() - self._checked_at < RECHECK_S:
                return
            network.require_bridge_netfilter()
            network.require_subnet_free(self.settings.subnet, self.settings.bridge)
            conf = json.dumps(conflist(self.settings), indent=1).encode()
            private_dir(self.settings.cache_dir)  # its results are named by container ids: root only
            path = self.settings.cache_dir / f"{self.settings.name}.conflist"
            # Written only when it differs: it is the same at every check but the first, and each
            # (fsynced) write of it cost a journal commit inside a create.
            if read_small(path) != conf:
                bundle.write_atomic(path, conf)
            # The firewall plugin makes CNI-ADMIN on its first ADD; the hook needs it now.
            if _iptables("-n", "-L", ADMIN_CHAIN).exit_code != 0:
                _iptables("-N", ADMIN_CHAIN)
            network.install_rules(self.settings.net, forward_parent=ADMIN_CHAIN)
            self._checked_at = time.monotonic()

    def teardown(self) -> None:
        """Remove the isolation rules and the bridge (call only when no sandbox uses them)."""
        with self._lock:
            self._checked_at = None  # the next create installs them again
            network.remove_rules(self.settings.net, forward_parent=ADMIN_CHAIN)
            proc.run(["ip", "link", "del", self.settings.bridge], timeout=_PLUGIN_TIMEOUT_S, check=False)

    # --- per sandbox -------------------------------------------------------------

    def _invoke(
        self, command: CniCommand, plugin: dict[str, Any], container_id: str, netns: Path | None, prev: Any
    ) -> dict[str, Any] | None:
        conf = {**plugin, "cniVersion": CNI_VERSION, "name": self.settings.name}
        if prev is not None:
            conf["prevResult"] = prev
        env = {
            "CNI_COMMAND": command.value,
            "CNI_CONTAINERID": self.cni_id(container_id),
            # DEL of a sandbox whose netns is already gone: "" (the plugins then only release what they hold).
            "CNI_NETNS": str(netns) if netns is not None and netns.exists() else "",
            "CNI_IFNAME": IFNAME,
            "CNI_PATH": str(self.settings.plugin_dir),
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        }
        exe = self.settings.plugin_dir / str(plugin["type"])
        try:
            done = proc.run(
                [str(exe)], env=env, input=json.dumps(conf).encode(), timeout=_PLUGIN_TIMEOUT_S, check=False
            )
        except CommandError as exc:
            raise ContainerRuntimeError(
                f"CNI plugin {exe} cannot run: {exc.message}",
                container=container_id,
                hint="Install the CNI plugins (Debian's containernetworking-plugins; `make setup`).",
            ) from exc
        if done.exit_code != 0:
            raise ContainerRuntimeError(
                f"CNI {command.value} of {container_id} failed in plugin {plugin['type']}: "
                f"{_plugin_error(done.out or done.err)}",
                container=container_id,
            )
        if command is not CniCommand.ADD:
            return None
        try:
            result: dict[str, Any] = json.loads(done.out)
        except ValueError as exc:
            raise ContainerRuntimeError(
                f"CNI plugin {plugin['type']} printed no JSON result: {done.out[:200]!r}", container=container_id
            ) from exc
        return result

    def add(self, container_id: str, netns: Path) -> CniResult:
        """Attach the namespace at ``netns`` to the network (runs every plugin's ADD; undone on failure)."""
        prev: dict[str, Any] | None = None
        try:
            for plugin in conflist(self.settings)["plugins"]:
                prev = self._invoke(CniCommand.ADD, plugin, container_id, netns, prev)
            assert prev is not None
            result = CniResult.parse(prev)
        except BaseException:
            # The spec: a failed ADD is followed by a DEL (each plugin's DEL tolerates what was never added).
            self._delete_plugins(container_id, netns, prev)
            raise
        results = self.settings.result_path(container_id)
        results.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        bundle.write_atomic(results, json.dumps(prev).encode())
        return result

    def cached(self, container_id: str) -> CniResult | None:
        """The ADD result kept for ``container_id`` (None if none)."""
        raw = self._cached_raw(container_id)
        return CniResult.parse(raw) if raw is not None else None

    def _cached_raw(self, container_id: str) -> dict[str, Any] | None:
        paths = [self.settings.result_path(container_id)]
        claimed = self.cni_id(container_id)
        if claimed != container_id:
            paths.append(self.settings.result_path(claimed))  # claimed, not yet renamed (a crash in take_over)
        for path in paths:
            try:
                data: dict[str, Any] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            return data
        return None

    def cni_id(self, container_id: str) -> str:
        """The CNI container id of ``container_id``'s attachment: its own, or the network slot's it took over."""
        try:
            claimed = self.settings.claim_path(container_id).read_text().strip()
        except OSError:
            return container_id
        return claimed or container_id

    def take_over(self, slot_id: str, container_id: str) -> None:
        """Record that ``container_id`` owns the attachment ADDed as ``slot_id`` (before anything of it moves).

        From here on a DEL of the container releases the slot's lease and
        rules, whatever else a crash leaves undone (:meth:`adopt_result`).
        """
        claim = self.settings.claim_path(container_id)
        private_dir(claim.parent)
        bundle.write_atomic(claim, slot_id.encode())

    def adopt_result(self, slot_id: str, container_id: str) -> None:
        """Move the slot's kept ADD result to the container's name (after :meth:`take_over` and the move)."""
        os.replace(self.settings.result_path(slot_id), self.settings.result_path(container_id))

    def _delete_plugins(self, container_id: str, netns: Path | None, prev: dict[str, Any] | None) -> list[str]:
        errors = []
        for plugin in reversed(conflist(self.settings)["plugins"]):
            try:
                self._invoke(CniCommand.DEL, plugin, container_id, netns, prev)
            except ContainerRuntimeError as exc:
                errors.append(exc.message)
        return errors

    def delete(self, container_id: str, netns: Path | None) -> None:
        """Detach ``container_id`` (every plugin's DEL, in reverse); idempotent, also after a crash."""
        errors = self._delete_plugins(container_id, netns, self._cached_raw(container_id))
        if errors:
            raise ContainerRuntimeError("; ".join(errors), container=container_id)
        claimed = self.cni_id(container_id)
        if claimed != container_id:
            self.settings.result_path(claimed).unlink(missing_ok=True)
        self.settings.result_path(container_id).unlink(missing_ok=True)
        self.settings.claim_path(container_id).unlink(missing_ok=True)

    def check(self, container_id: str, netns: Path) -> None:
        """Every plugin's CHECK against the cached result; ContainerRuntimeError if one finds a difference."""
        prev = self._cached_raw(container_id)
        if prev is None:
            raise ContainerRuntimeError(f"no CNI result is kept for {container_id}", container=container_id)
        for plugin in conflist(self.settings)["plugins"]:
            self._invoke(CniCommand.CHECK, plugin, container_id, netns, prev)

    def attached(self) -> list[str]:
        """Ids with a kept ADD result (for re-adoption and clean-up)."""
        d = self.settings.cache_dir / "results"
        return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []
