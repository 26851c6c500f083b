"""crab's pinned images, for operators (``crabctl image ls|prune``): the ``crab.v1.CrabImages`` service.

Functions over a :class:`~crabd.sdk.Client` rather than methods of it: they
are host administration, not something an agent's code needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast, get_args

import grpc

from crabd.api.v1 import images_pb2 as pb
from crabd.api.v1 import images_pb2_grpc as pb_grpc
from crabd.sdk.client import Client
from crabd.vocabulary import PinState


@dataclass(frozen=True)
class PinnedImageInfo:
    digest: str
    size: int
    tags: list[str]
    #: When crab last pinned it (unix time; 0 unknown).
    pinned_at: float
    sandboxes: int
    checkpoints: int
    remote_checkpoints: int
    #: crabd instances on this host that claim it.
    claims: int
    #: "in use", "grace", "claimed" (by another crabd instance) or "removable".
    state: PinState
    #: State "grace": removable from then on (unix time).
    removable_at: float


@dataclass(frozen=True)
class PruneResult:
    #: Digests removed (a dry run: that would be).
    removed: list[str]
    #: Digest -> why it stays.
    left: dict[str, str] = field(default_factory=dict)
    exports_removed: int = 0
    bytes_freed: int = 0
    #: Creates held the lock: nothing was looked at; try again.
    busy: bool = False
    dry_run: bool = False


def _send(client: Client, rpc: str, request: Any) -> Any:
    client._ensure_open()
    stub = pb_grpc.CrabImagesStub(client._channel)
    try:
        return getattr(stub, rpc)(request, timeout=client.timeout)
    except grpc.RpcError as exc:
        raise client._error(exc) from exc


def _state(word: str) -> PinState:
    """The reply's state word, checked against the vocabulary (a newer crabd's word reads as "in use")."""
    for known in get_args(PinState):
        if word == known:
            return cast(PinState, known)
    return "in use"


def list_pinned_images(client: Client) -> list[PinnedImageInfo]:
    """Every image crabd pinned (``crab-loaded:<hex>``) or claims, with what names it."""
    reply = _send(client, "ListPinnedImages", pb.ListPinnedImagesRequest())
    return [
        PinnedImageInfo(
            i.digest,
            i.size,
            list(i.tags),
            i.pinned_at,
            i.sandboxes,
            i.checkpoints,
            i.remote_checkpoints,
            i.claims,
            _state(i.state),
            i.removable_at,
        )
        for i in reply.images
    ]


def prune_pinned_images(client: Client, *, dry_run: bool = False) -> PruneResult:
    """One collection now (root only): every pinned image nothing needs goes."""
    r = _send(client, "PrunePinnedImages", pb.PrunePinnedImagesRequest(dry_run=dry_run))
    return PruneResult(
        list(r.removed),
        {x.digest: x.reason for x in r.left},
        r.exports_removed,
        r.bytes_freed,
        r.busy,
        r.dry_run,
    )
