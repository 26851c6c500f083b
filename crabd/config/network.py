"""The network sections of crabd's configuration: sandboxes' egress ([network]) and the OpenAI proxy ([proxy])."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from crabd.config.section import Section


def parse_allow(text: str) -> tuple[str, int | None]:
    """A [network] allow entry, ``CIDR`` or ``CIDR:PORT`` (IPv4), as ``(network, port)``."""
    addr, sep, port = text.rpartition(":")
    if not sep:
        addr, port = text, ""
    try:
        net = ipaddress.IPv4Network(addr.strip(), strict=False)
    except ValueError as exc:
        raise ValueError(f"{text!r}: not an IPv4 address or CIDR (optionally :PORT): {exc}") from exc
    if port and (not port.isdigit() or not 0 < int(port) <= 65535):
        raise ValueError(f"{text!r}: bad port {port!r}")
    return str(net), int(port) if port else None


class NetworkConfig(Section):
    """How sandboxes with a network are kept apart (see docs/security.md, "Isolation")."""

    isolate: bool = Field(
        True,
        description="put networked sandboxes on crab's own bridge, with firewall rules; "
        "false: Docker's default bridge, where sandboxes reach each other and the host",
    )
    name: str = Field(
        "crab",
        pattern=r"^[a-z][a-z0-9]{0,9}$",
        description="names the Docker network (<name>-sandboxes), its bridge (<name>0) and iptables chains",
    )
    allow: tuple[str, ...] = Field(
        (),
        description="destinations sandboxes may reach although blocked (host addresses, link-local): "
        "IPv4 CIDR or CIDR:PORT (TCP and UDP)",
    )
    deny: tuple[str, ...] = Field(
        ("169.254.0.0/16",),
        description="routed destinations sandboxes may not reach (besides the host itself and each other)",
    )

    @field_validator("allow")
    @classmethod
    def _allow_entries(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            parse_allow(entry)
        return value

    @field_validator("deny")
    @classmethod
    def _deny_entries(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            try:
                ipaddress.IPv4Network(entry, strict=False)
            except ValueError as exc:
                raise ValueError(f"{entry!r}: not an IPv4 CIDR: {exc}") from exc
        return value


def split_host_port(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as ``(host, port)``; ``ValueError`` if it is neither."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{text!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        # A bare IPv6 address is ambiguous with its port; insist on brackets.
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, e.g. [::1]:8731")
    value = int(port)
    if value > 65535:
        raise ValueError(f"{text!r}: port {value} is out of range")
    return host, value


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback IP literal (names are refused: they could resolve elsewhere)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ProxyConfig(Section):
    """The OpenAI-compatible proxy that ends a sandbox's turn at each LLM request (see docs/proxy.md)."""

    enabled: bool = Field(False, description="crabd starts the proxy only when this is true")
    listen: str = Field(
        "127.0.0.1:8731",
        description="host:port the proxy listens on; a loopback IP only ([::1]:port for IPv6; port 0 = any free port)",
    )
    upstream: str = Field(
        "http://127.0.0.1:8000", description="the OpenAI-compatible server requests go to, as http(s)://host:port"
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="longest wait to connect to the upstream")
    upstream_timeout_s: float = Field(
        600.0, gt=0, description="longest one upstream response may take, start to end (time held included)"
    )
    max_request_bytes: int = Field(64 << 20, gt=0, description="largest request body the proxy accepts (else 413)")
    max_concurrent_requests: int = Field(
        256, gt=0, description="requests served at once, all callers together; one more is answered 429"
    )
    max_buffered_bytes: int = Field(
        256 << 20,
        gt=0,
        description="request body bytes held in memory at once, all requests together; a request past it gets 429",
    )
    group: str = Field(
        "crab", min_length=1, description="callers must be root or members of this group (as for crabd's socket)"
    )

    @field_validator("listen")
    @classmethod
    def _loopback_only(cls, value: str) -> str:
        host, _ = split_host_port(value)
        if not is_loopback(host):
            # Who is calling is read from the kernel's loopback socket table
            # (crabd/util/loopback_peer.py); off loopback that identity means nothing.
            raise ValueError(f"{value!r}: the proxy listens on a loopback address only (127.0.0.1 or [::1])")
        return value

    @field_validator("upstream")
    @classmethod
    def _http_host_port(cls, value: str) -> str:
        parts = urlsplit(value)
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{value!r}: {exc}") from exc
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise ValueError(f"{value!r} is not http(s)://host:port")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError(f"{value!r}: give only scheme, host and port (the proxy appends /v1/...)")
        return value.rstrip("/")

    @property
    def listen_address(self) -> tuple[str, int]:
        """``listen`` as ``(host, port)``."""
        return split_host_port(self.listen)
