"""Keeping networked sandboxes apart: crab's own bridge plus firewall rules.

Docker's default bridge lets every container reach every other one and the
host's services, so one tenant's sandbox could talk to another's.  Every
sandbox created with a network instead joins one Docker bridge network of
crab's (``<name>-sandboxes``, Linux bridge ``<name>0``) created with
inter-container communication off (``enable_icc=false``), and two iptables
chains of crab's own filter what leaves it:

``<NAME>-SANDBOX-IN`` (jumped to from ``INPUT -i <name>0``): traffic from a
sandbox to the host itself, on any of the host's addresses.  Replies to
connections the host opened pass; ``[network] allow`` entries pass; the rest
is rejected (a TCP reset or ICMP unreachable, so tools fail fast instead of
hanging).

``<NAME>-SANDBOX-FWD`` (jumped to from ``DOCKER-USER -i <name>0``, which
Docker's FORWARD chain runs before its own rules): routed traffic.  Replies
pass, ``allow`` entries pass, traffic back into the bridge (sandbox to
sandbox) and to ``[network] deny`` (default: link-local 169.254.0.0/16, where
cloud metadata services live) is rejected, and everything else returns to
Docker's chains (NAT to the outside world as before).  Traffic between two
sandboxes on one bridge is seen by iptables only with br_netfilter on
(``net.bridge.bridge-nf-call-iptables = 1``; Docker loads it for an icc=false
network): :func:`ensure` refuses to go on without it.

Each ensure rewrites both chains in one ``iptables-restore --noflush``
transaction (atomic: no moment without rules) and adds a jump only when
``iptables -C`` does not find it, so it is idempotent and repairs rules that
were removed by hand.  The rules are host-wide and stay while crabd is
stopped (its sandboxes keep running); :func:`teardown` removes them and the
network.  IPv6 is not routed for sandboxes (the network has none, and
:data:`SANDBOX_SYSCTLS` turns it off inside), so no ip6tables rules are needed.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from crabd.backends.docker_errors import docker_errors
from crabd.config import NetworkConfig, parse_allow
from crabd.errors import CommandError, HostError
from crabd.util import proc

_BR_NETFILTER = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
#: The host's main IPv4 routing table (crabd runs in the host's network namespace).
_ROUTES = Path("/proc/net/route")
#: More than any host has routes; a bigger file is not read whole.
_ROUTES_MAX_BYTES = 4 << 20
_IPTABLES_TIMEOUT_S = 30.0
LABEL_NETWORK = "dev.crab.network"

#: Set in every networked sandbox: no IPv6, so nothing bypasses the IPv4 rules
#: (link-local fe80:: between sandboxes on one bridge, say).
SANDBOX_SYSCTLS = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}


def network_name(cfg: NetworkConfig) -> str:
    return f"{cfg.name}-sandboxes"


def bridge_name(cfg: NetworkConfig) -> str:
    return f"{cfg.name}0"


def chain_names(cfg: NetworkConfig) -> tuple[str, str]:
    """(input chain, forward chain)."""
    base = cfg.name.upper()
    return f"{base}-SANDBOX-IN", f"{base}-SANDBOX-FWD"


def _allow_rules(chain: str, cfg: NetworkConfig) -> list[str]:
    out = []
    for entry in cfg.allow:
        net, port = parse_allow(entry)
        if port is None:
            out.append(f"-A {chain} -d {net} -j RETURN")
        else:
            out += [f"-A {chain} -d {net} -p {p} -m {p} --dport {port} -j RETURN" for p in ("tcp", "udp")]
    return out


def _reject(chain: str, match: str = "") -> list[str]:
    m = f"{match} " if match else ""
    return [f"-A {chain} {m}-p tcp -j REJECT --reject-with tcp-reset", f"-A {chain} {m}-j REJECT"]


def restore_script(cfg: NetworkConfig) -> str:
    """The ``iptables-restore --noflush`` input that (re)writes crab's two chains."""
    chain_in, chain_fwd = chain_names(cfg)
    bridge = bridge_name(cfg)
    replies = "-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN"
    lines = ["*filter", f":{chain_in} - [0:0]", f":{chain_fwd} - [0:0]"]
    lines += [f"-A {chain_in} {replies}", *_allow_rules(chain_in, cfg), *_reject(chain_in)]
    lines += [f"-A {chain_fwd} {replies}", *_allow_rules(chain_fwd, cfg), *_reject(chain_fwd, f"-o {bridge}")]
    for net in cfg.deny:
        lines += _reject(chain_fwd, f"-d {net}")
    lines += [f"-A {chain_fwd} -j RETURN", "COMMIT", ""]
    return "\n".join(lines)


def jumps(cfg: NetworkConfig, forward_parent: str = "DOCKER-USER") -> list[tuple[str, list[str]]]:
    """(parent chain, rule) of the two jumps into crab's chains (CNI networks hook routed traffic in CNI-ADMIN)."""
    chain_in, chain_fwd = chain_names(cfg)
    bridge = bridge_name(cfg)
    return [("INPUT", ["-i", bridge, "-j", chain_in]), (forward_parent, ["-i", bridge, "-j", chain_fwd])]


def _iptables(*args: str, check: bool = True) -> proc.Completed:
    # -w: wait for the xtables lock (dockerd edits the same tables).
    return proc.run(["iptables", "-w", *args], timeout=_IPTABLES_TIMEOUT_S, check=check)


def install_rules(cfg: NetworkConfig, forward_parent: str = "DOCKER-USER") -> None:
    """Write crab's chains and hook them in (idempotent)."""
    try:
        proc.run(
            ["iptables-restore", "-w", "--noflush"],
            input=restore_script(cfg).encode(),
            timeout=_IPTABLES_TIMEOUT_S,
        )
        for parent, rule in jumps(cfg, forward_parent):
            if _iptables("-C", parent, *rule, check=False).exit_code != 0:
                _iptables("-I", parent, "1", *rule)
    except CommandError as exc:
        raise HostError(
            f"cannot install the sandbox firewall rules: {exc.message}",
            hint="crabd needs iptables (and Docker's DOCKER-USER chain: start dockerd first).",
        ) from exc


def remove_rules(cfg: NetworkConfig, forward_parent: str = "DOCKER-USER") -> None:
    """Unhook and delete crab's chains; what is already gone is not an error."""
    for parent, rule in jumps(cfg, forward_parent):
        while _iptables("-C", parent, *rule, check=False).exit_code == 0:
            _iptables("-D", parent, *rule, check=False)
    for chain in chain_names(cfg):
        _iptables("-F", chain, check=False)
        _iptables("-X", chain, check=False)


def _ensure_network(api: Any, cfg: NetworkConfig) -> None:
    # Here, not at the top: the runc backend imports this module for its rules, never Docker.
    import docker.errors

    name, bridge = network_name(cfg), bridge_name(cfg)
    options = {
        "com.docker.network.bridge.name": bridge,
        "com.docker.network.bridge.enable_icc": "false",
        "com.docker.network.bridge.enable_ip_masquerade": "true",
    }
    with docker_errors(f"inspect network {name}"):
        try:
            found = api.inspect_network(name)
        except docker.errors.NotFound:
            found = None
    if found is None:
        with docker_errors(f"create network {name}"):
            try:
                api.create_network(
                    name, driver="bridge", options=options, labels={LABEL_NETWORK: cfg.name}, check_duplicate=True
                )
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # another crabd thread or process made it meanwhile
                    raise
        with docker_errors(f"inspect network {name}"):
            found = api.inspect_network(name)
    have = found.get("Options") or {}
    if found.get("Driver") != "bridge" or any(have.get(k) != v for k, v in options.items()):
        # Never join sandboxes to a network someone else made with other settings.
        raise HostError(
            f"Docker network {name} exists with other settings than crab's (driver {found.get('Driver')}, {have})",
            hint=f"Remove it (`docker network rm {name}`) or set [network] name to another name.",
        )


def require_bridge_netfilter() -> None:
    """HostError unless br_netfilter shows bridged traffic to iptables (else sandboxes on one bridge meet)."""
    try:
        br_nf = _BR_NETFILTER.read_text().strip()
    except OSError:
        br_nf = "absent"
    if br_nf != "1":
        raise HostError(
            f"bridge netfilter is off ({_BR_NETFILTER}: {br_nf}): sandboxes on one bridge could reach each other",
            hint="Load br_netfilter and set net.bridge.bridge-nf-call-iptables = 1 "
            "(or set [network] isolate = false to accept shared networking).",
        )


def host_routes(path: Path | None = None) -> list[tuple[ipaddress.IPv4Network, str]]:
    """The main table's IPv4 routes as ``(destination, device)``, read from ``/proc/net/route``.

    Each line after the header is ``Iface Destination Gateway Flags RefCnt Use
    Metric Mask ...``; destination and mask are the address's four bytes printed
    as one native-endian hex word, so they are packed back in native order.
    """
    with (path or _ROUTES).open("rb") as f:
        text = f.read(_ROUTES_MAX_BYTES).decode("ascii", "replace")
    out = []
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 8:
            continue
        try:
            dst, mask = (socket.inet_ntoa(struct.pack("=I", int(cols[i], 16))) for i in (1, 7))
            out.append((ipaddress.IPv4Network(f"{dst}/{mask}"), cols[0]))
        except (ValueError, struct.error):
            continue  # not a route line this parser knows; it cannot be crab's bridge's either
    return out


def require_subnet_free(subnet: str, bridge: str) -> None:
    """HostError if another device routes any of ``subnet``: the host could not reach sandboxes on ``bridge``.

    Two connected routes for one prefix on two devices send the host's packets
    for a sandbox out of whichever came first; a more specific one on another
    device takes a part of the subnet.  Either way the host's connects fail with
    "No route to host" (ARP on the wrong link), or reach someone else's machine.
    This happens when two networks' derived subnets meet (``[runtime] subnet``),
    or a bridge of a crabd gone for good was left behind.  A broader route (the
    default route, a VPN's 10/8) is shadowed by the bridge's own and is no clash.
    """
    net = ipaddress.IPv4Network(subnet)
    clash = sorted(
        {
            (str(dst), dev)
            for dst, dev in host_routes()
            if dev != bridge and dst.prefixlen >= net.prefixlen and dst.overlaps(net)
        }
    )
    if clash:
        where = ", ".join(f"{dst} on {dev}" for dst, dev in clash)
        raise HostError(
            f"the sandbox subnet {net} of bridge {bridge} is already routed elsewhere ({where}): "
            "the host could not reach sandboxes on it",
            hint="Set [runtime] subnet to a free IPv4 subnet, or remove what routes it "
            "(a crab bridge left behind: `ip link del <device>`).",
        )


class SandboxNetwork:
    """The network networked sandboxes join; :meth:`ensure` before each create."""

    def __init__(self, api: Any, cfg: NetworkConfig) -> None:
        self.api = api
        self.cfg = cfg
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return network_name(self.cfg)

    def ensure(self) -> str:
        """Make the network and the rules exist (idempotent; blocking); returns the network's name."""
        with self._lock:
            _ensure_network(self.api, self.cfg)
            require_bridge_netfilter()
            install_rules(self.cfg)
            return self.name


def teardown(api: Any, cfg: NetworkConfig) -> bool:
    """Remove crab's network and then its rules; False (and nothing removed) while a container uses it."""
    import docker.errors  # see _ensure_network

    with docker_errors(f"remove network {network_name(cfg)}"):
        try:
            api.remove_network(network_name(cfg))
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code in (403, 409):  # "has active endpoints": sandboxes still need the rules
                return False
            raise
    remove_rules(cfg)
    return True
