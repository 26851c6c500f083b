"""crab's pins of images in the host's Docker: ``crab-loaded:<digest hex>``, for both sandbox backends.

Both backends take their images from Docker (the runc backend exports each
once: ``runc/rootfs.py``), so the pin is a Docker tag either way; the runc
backend removes its export on top (``RuncSandboxBackend.unpin_image``).

* The tag is set **by id** (the digest just read), never by the name the
  caller gave: a re-tag of that name meanwhile cannot make crab pin another
  image than the one it records.
* Every pin tags again, so Docker's ``LastTagTime`` of the image says when
  crab last pinned it (a ``docker load`` leaves it unset).
* An env image (``crab-env/...``) is never pinned: crab builds and keeps those.
* The removal is ``docker rmi crab-loaded:<hex>``, never forced: another name
  keeps the image (it is only untagged), a container of it makes Docker
  refuse (reported, nothing changed).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from crabd.backends.docker_errors import docker_errors
from crabd.backends.sandbox import ENV_REPO_PREFIX, PIN_REPO, PinnedImage, Unpinned
from crabd.errors import DockerError, ImageError
from crabd.util.validate import IMAGE_DIGEST_RE


def pin_tag(digest: str) -> str:
    """crab's tag of the image with ``digest``."""
    return f"{PIN_REPO}:{digest.removeprefix('sha256:')}"


def _inspect(api: Any, image: str) -> dict[str, Any]:
    try:
        with docker_errors(f"inspecting image {image}"):
            found: dict[str, Any] = api.inspect_image(image)
    except ImageError as exc:
        raise ImageError(f"no Docker image {image!r} on this host", env=image) from exc
    return found


def _digest(info: dict[str, Any], image: str) -> str:
    ident = str(info.get("Id", ""))
    if not IMAGE_DIGEST_RE.match(ident):
        raise ImageError(f"Docker reports no digest for image {image!r}", env=image)
    return ident


def _is_env(tags: list[str] | tuple[str, ...]) -> bool:
    return any(t.startswith(ENV_REPO_PREFIX) for t in tags)


def pin(api: Any, image: str) -> str:
    """The digest of ``image``, tagged ``crab-loaded:<hex>`` unless it is an env image (module doc)."""
    info = _inspect(api, image)
    digest = _digest(info, image)
    if image.startswith(ENV_REPO_PREFIX) or _is_env(list(info.get("RepoTags") or ())):
        return digest
    with docker_errors(f"pinning image {digest} as {pin_tag(digest)}"):
        api.tag(digest, PIN_REPO, digest.removeprefix("sha256:"))
    return digest


def _when(text: object) -> float:
    """Docker's ``LastTagTime`` as unix time; 0 for "never" (0001-01-01) or anything unreadable."""
    try:
        at = datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError, OSError):
        return 0.0
    return max(at, 0.0)


def pinned(api: Any) -> list[PinnedImage]:
    """Every image whose tags hold ``crab-loaded:<its own id hex>``."""
    with docker_errors(f"listing the {PIN_REPO} images"):
        rows: list[dict[str, Any]] = api.images(name=PIN_REPO)
    out: list[PinnedImage] = []
    for row in rows:
        digest = str(row.get("Id", ""))
        tags = tuple(str(t) for t in row.get("RepoTags") or ())
        if not IMAGE_DIGEST_RE.match(digest) or pin_tag(digest) not in tags:
            continue  # a crab-loaded tag that does not name its own image's id is no pin of crab's
        try:
            info = _inspect(api, digest)
        except ImageError:  # removed meanwhile
            continue
        at = _when((info.get("Metadata") or {}).get("LastTagTime"))
        out.append(PinnedImage(digest, int(row.get("Size") or 0), tags, at))
    return sorted(out, key=lambda p: p.digest)


def unpin(api: Any, digest: str) -> Unpinned:
    """Remove crab's tag of ``digest`` (never forced: module doc)."""
    tag = pin_tag(digest)
    try:
        info = _inspect(api, tag)
    except ImageError:
        return Unpinned(untagged=True, note="not pinned")
    if info.get("Id") != digest:
        return Unpinned(untagged=False, note=f"{tag} names another image ({info.get('Id')}); left alone")
    others = [t for t in info.get("RepoTags") or () if t != tag]
    try:
        with docker_errors(f"removing {tag}"):
            api.remove_image(tag, force=False)
    except ImageError:
        return Unpinned(untagged=True, note="gone meanwhile")
    except DockerError as exc:
        if exc.status == 409:  # a container of the image exists (crab's or anyone's): Docker keeps it
            return Unpinned(untagged=False, note=exc.message)
        raise
    return Unpinned(untagged=True, deleted=not others, env=_is_env(others))
