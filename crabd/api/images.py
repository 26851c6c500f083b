"""The gRPC servicer of ``crab.v1.CrabImages`` (``v1/images.proto``): crab's pinned images.

A service of its own beside ``crab.v1.Crab``, on the same server and socket;
the caller is identified, and errors are mapped, exactly as there (it uses
:class:`~crabd.api.servicer.CrabServicer`'s own ``_call``).
"""

from __future__ import annotations

from typing import Any

from crabd.api.servicer import CrabServicer
from crabd.api.v1 import images_pb2 as pb
from crabd.api.v1 import images_pb2_grpc as pb_grpc
from crabd.models import Caller
from crabd.service.pinned_images import PinnedImages


class ImagesServicer(pb_grpc.CrabImagesServicer):
    def __init__(self, crab: CrabServicer, images: PinnedImages) -> None:
        self.crab = crab
        self.images = images

    async def ListPinnedImages(self, request: pb.ListPinnedImagesRequest, context: Any) -> pb.ListPinnedImagesResponse:
        async def go(c: Caller) -> pb.ListPinnedImagesResponse:
            rows = await self.images.listing(c)
            return pb.ListPinnedImagesResponse(
                images=[
                    pb.PinnedImageInfo(
                        digest=r.digest,
                        size=r.size,
                        tags=list(r.tags),
                        pinned_at=r.pinned_at,
                        sandboxes=r.sandboxes,
                        checkpoints=r.checkpoints,
                        remote_checkpoints=r.remote_checkpoints,
                        claims=r.claims,
                        state=r.state,
                        removable_at=r.removable_at,
                    )
                    for r in rows
                ]
            )

        return await self.crab._call(context, go)

    async def PrunePinnedImages(
        self, request: pb.PrunePinnedImagesRequest, context: Any
    ) -> pb.PrunePinnedImagesResponse:
        async def go(c: Caller) -> pb.PrunePinnedImagesResponse:
            r = await self.images.prune(c, dry_run=request.dry_run)
            return pb.PrunePinnedImagesResponse(
                removed=r.removed,
                left=[pb.LeftImage(digest=d, reason=why) for d, why in sorted(r.left.items())],
                exports_removed=r.exports_removed,
                bytes_freed=r.bytes_freed,
                busy=r.busy,
                dry_run=r.dry_run,
            )

        return await self.crab._call(context, go)
