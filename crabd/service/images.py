"""The service's edge for a new sandbox's image: an env, or any image the host's Docker has.

* ``env``: one of crab's env images (``crab-env/<env>``, built from a
  recipe); ``image="crab-env/<env>"`` (no tag) is the same request.
* ``image``: a Docker reference (a name, ``name:tag``, ``name@sha256:...``
  or an id), checked by :func:`crabd.util.validate.image_ref` (it can never
  be read as an option to ``docker``), or the absolute path of a
  ``docker save`` archive or an OCI image layout, which crabd reads with the
  caller's own permissions (``backends/image_archive.py``) and loads once.

Who may use which image: any member of group ``crab`` may start any image
the host's Docker has (docs/security.md, "Images"): images are content the
host's admin provides.  A path is the caller's: crabd never reads one the
caller could not read.  The record names the image by digest either way
(an env's sandbox by its content-tagged build, as before).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace

from crabd.config import CrabConfig
from crabd.coordinator.image_sources import ImageLoader
from crabd.coordinator.sandboxes import SandboxManager
from crabd.errors import InvalidRequest
from crabd.host.images import REPO_PREFIX
from crabd.models import Caller, SandboxSpec
from crabd.util import validate

#: ``crab-env/<env>`` without a tag: the env's current build, as ``env=<env>`` asks.
_ENV_SHORTCUT = re.compile(re.escape(REPO_PREFIX) + r"/([a-z0-9][a-z0-9._-]{0,63})\Z")


def image_source(spec: SandboxSpec) -> tuple[SandboxSpec, str]:
    """``spec`` with its image checked (an env shortcut made its env), and the path to load ("" if none)."""
    if spec.image and spec.env:
        raise InvalidRequest(
            f"both an env ({spec.env[:64]!r}) and an image ({spec.image[:200]!r}) were given",
            hint="Give one: env names one of crab's env images, image any image the host's Docker has.",
        )
    if not spec.image:
        if not spec.env:
            raise InvalidRequest(
                "no env or image given",
                hint="Name the env, e.g. `crabctl create bookworm` (`crabctl env ls`), or an image: --image debian:12.",
            )
        return spec, ""
    ref = validate.image_ref(spec.image)
    shortcut = _ENV_SHORTCUT.match(ref)
    if shortcut is not None:
        return replace(spec, env=shortcut[1], image=""), ""
    return spec, ref if validate.is_image_path(ref) else ""


class ImageEdge:
    def __init__(self, cfg: CrabConfig, sandboxes: SandboxManager) -> None:
        self.loader = ImageLoader(
            cfg.paths.state_dir / "image-staging", cfg.limits.max_image_archive_bytes, sandboxes.backend
        )
        self.keeper = sandboxes.images

    async def spec_for(self, caller: Caller, spec: SandboxSpec) -> SandboxSpec:
        """The spec to create: checked, and an archive's or layout's image loaded and named by its digest."""
        spec, path = image_source(spec)
        if path:
            # Loaded and pinned under the claims lock, so a collection cannot take the image
            # between the two; the create pins it again, well inside the grace (image_gc.py).
            async with self.keeper.pinning():
                digest = await self.loader.load(path, caller.uid, caller.gid)
                spec = replace(spec, image=await asyncio.to_thread(self.keeper.pin, digest))
        return spec
