"""A few rtnetlink requests (move a link to another netns, add an address, set a link up, add a route), no `ip`.

For the hand-over of a network slot (:mod:`.slots`): two `ip` processes
per create cost 10-100 ms on a loaded 2-core host, the same requests over a
netlink socket well under one.  A netlink socket acts in the network
namespace of the thread that opened it, so the caller runs these on a
throwaway thread that entered the namespace first (:func:`.named_netns.enter`).

Message layouts are the kernel's (include/uapi/linux/netlink.h, rtnetlink.h,
if_link.h, if_addr.h): a ``nlmsghdr``, the request's fixed header, then
attributes (``rtattr``: length, type, payload padded to 4 bytes).  Every
request asks for an ACK; a negative errno in it is raised as OSError.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

NLMSG_ERROR = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
RTM_NEWLINK = 16
RTM_NEWADDR = 20
RTM_NEWROUTE = 24
IFLA_NET_NS_FD = 28
IFA_LOCAL = 2
IFA_ADDRESS = 1
IFA_BROADCAST = 4
RTA_DST = 1
RTA_OIF = 4
RTA_GATEWAY = 5
IFF_UP = 0x1
RT_TABLE_MAIN = 254
RTPROT_BOOT = 3
RT_SCOPE_UNIVERSE = 0
RTN_UNICAST = 1

_HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_IFINFO = struct.Struct("=BBHiII")  # ifinfomsg: family, pad, type, index, flags, change
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags


def attr(kind: int, payload: bytes) -> bytes:
    """One ``rtattr``, padded to 4 bytes."""
    head = struct.pack("=HH", 4 + len(payload), kind)
    pad = (-len(payload)) % 4
    return head + payload + b"\0" * pad


def message(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    return _HDR.pack(_HDR.size + len(body), kind, NLM_F_REQUEST | NLM_F_ACK | flags, seq, 0) + body


def move_link(index: int, netns_fd: int) -> bytes:
    body = _IFINFO.pack(socket.AF_UNSPEC, 0, 0, index, 0, 0) + attr(IFLA_NET_NS_FD, struct.pack("=I", netns_fd))
    return message(RTM_NEWLINK, 0, 1, body)


def link_up(index: int) -> bytes:
    return message(RTM_NEWLINK, 0, 2, _IFINFO.pack(socket.AF_UNSPEC, 0, 0, index, IFF_UP, IFF_UP))


def add_address(index: int, addr: ipaddress.IPv4Interface) -> bytes:
    packed = addr.ip.packed
    body = _IFADDR.pack(socket.AF_INET, addr.network.prefixlen, 0, RT_SCOPE_UNIVERSE, index)
    body += attr(IFA_LOCAL, packed) + attr(IFA_ADDRESS, packed)
    if addr.network.prefixlen < 31:
        body += attr(IFA_BROADCAST, addr.network.broadcast_address.packed)
    return message(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, 3, body)


def add_route(index: int, dst: ipaddress.IPv4Network, via: ipaddress.IPv4Address) -> bytes:
    body = _RTMSG.pack(
        socket.AF_INET, dst.prefixlen, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_UNIVERSE, RTN_UNICAST, 0
    )
    if dst.prefixlen:
        body += attr(RTA_DST, dst.network_address.packed)
    body += attr(RTA_GATEWAY, via.packed) + attr(RTA_OIF, struct.pack("=i", index))
    return message(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, 4, body)


def parse_ack(data: bytes) -> int:
    """The errno an ACK carries (0: done); ValueError if ``data`` is no ACK."""
    if len(data) < _HDR.size + 4:
        raise ValueError(f"short netlink reply ({len(data)} bytes)")
    _, kind, _, _, _ = _HDR.unpack_from(data)
    if kind != NLMSG_ERROR:
        raise ValueError(f"netlink reply of type {kind}, not an ACK")
    err: int = struct.unpack_from("=i", data, _HDR.size)[0]
    return -err


def request(msg: bytes, what: str) -> None:
    """Send one request on a new rtnetlink socket (in the calling thread's netns); OSError if refused."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE) as s:
        s.bind((0, 0))
        s.send(msg)
        err = parse_ack(s.recv(65536))
    if err:
        raise OSError(err, f"{what}: {os.strerror(err)}")
