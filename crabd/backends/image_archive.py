"""Images from a path a caller names: a ``docker save`` archive, or an OCI image layout (a dir or a tar of one).

Both sandbox backends take their images from the host's Docker (the runc
backend exports each image once, by id: ``runc/rootfs.py``), so a path
source ends as an image in Docker, loaded once and then named by its digest
(Docker's image id: the SHA-256 of the image's config).  The archive is
hostile input, and crabd runs as root, so:

1. **Read as the caller** (:func:`stage_as`).  crabd never opens the
   caller's path itself: ``setpriv`` runs ``cat`` (a file) or ``tar -c``
   (a directory; symlinks are stored, never followed) with the caller's
   uid, gid and groups and no capabilities, writing into a staging file of
   crabd's under ``prlimit --fsize``: a file the caller may not read is
   refused by the kernel, and no more than the limit is ever written.
2. **Checked before use** (:func:`plan`).  One plain (uncompressed) tar,
   at most :data:`MAX_MEMBERS` members, no two with one name; exactly one
   image, found through ``manifest.json`` (``docker save``) or
   ``index.json`` (OCI: every index, manifest and config blob must hash to
   the digest that names it); its config and layers regular-file members;
   layers tar or gzip-compressed tar, as many as the config's ``diff_ids``.
3. **Loaded under crab's own manifest** (:func:`load`).  A new tar holds
   just that config and those layers, with a manifest crab wrote: the
   archive's own tags (``RepoTags``, a legacy ``repositories`` file) never
   reach Docker, so an archive cannot re-point a name (``crab-env/...``,
   ``debian:12``) other users create from.  The image is tagged
   ``crab-loaded:<digest hex>`` (so ``docker image prune`` keeps it); Docker
   checks each layer against the config's ``diff_ids`` as it loads.  An
   image whose digest Docker already has is not loaded again.

Any refusal changes nothing: the staging dir is removed either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pwd
import secrets
import shutil
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from crabd.errors import CommandError, ImageError, PermissionDenied
from crabd.util import proc
from crabd.util.private_dirs import private_dir
from crabd.util.validate import IMAGE_DIGEST_RE

#: The repository loaded images are tagged in (``crab-loaded:<digest hex>``).
LOADED_REPO = "crab-loaded"
#: Most members an archive may have.
MAX_MEMBERS = 100_000
#: Largest index, manifest or config JSON read into memory.
MAX_JSON_BYTES = 4 << 20
#: Prefix of a staging dir (``load-<pid>-<token>``); one a crash left is removed at the next start.
STAGE_PREFIX = "load-"

_STAGE_TIMEOUT_S = 1800.0
_LOAD_TIMEOUT_S = 1800.0
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_OCI_INDEX = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
_OCI_MANIFEST = ("application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json")
#: Layer media types Docker can load: a tar, or a gzip-compressed one (not zstd).
_LAYER_TYPES = (
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
)


@dataclass(frozen=True)
class Plan:
    """The one image an archive holds: its digest, its config's member and its layers' members (bottom first)."""

    digest: str
    config: str
    layers: tuple[str, ...]


def _refuse(path: str, why: str, hint: str | None = None) -> ImageError:
    return ImageError(
        f"{path} is not an image archive crab loads: {why}; nothing was loaded",
        env=path,
        hint=hint or "Give a `docker save` archive (plain tar) or an OCI image layout (a directory, or a tar of one).",
    )


# --- 1. the caller's read -----------------------------------------------------------------------


def _as_caller(uid: int, gid: int) -> list[str]:
    """``setpriv`` arguments that run a program as ``uid``/``gid`` with that user's groups, without capabilities."""
    if uid == 0:
        return []
    try:
        pwd.getpwuid(uid)
        groups = "--init-groups"
    except KeyError:  # no passwd entry: no supplementary groups either
        groups = "--clear-groups"
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", groups, "--no-new-privs", "--"]


def stage_as(path: str, uid: int, gid: int, into: Path, max_bytes: int) -> Path:
    """A copy of ``path`` as ``uid``/``gid`` read it, in ``into`` (a dir: packed as a tar); at most ``max_bytes``."""
    who = _as_caller(uid, gid)
    env = {"PATH": _PATH, "LC_ALL": "C"}
    probe = proc.run([*who, "test", "-d", path], timeout=30, check=False, env=env, cwd="/")
    reader = ["tar", "-c", "-f", "-", "-C", path, "."] if probe.exit_code == 0 else ["cat", "--", path]
    staged = into / "staged.tar"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        # One byte more than allowed may be written: a copy that reaches max_bytes + 1 was cut short.
        argv = ["prlimit", f"--fsize={max_bytes + 1}", "--", *who, *reader]
        done = proc.run(argv, timeout=_STAGE_TIMEOUT_S, check=False, env=env, cwd="/", stdout_fd=fd)
    finally:
        os.close(fd)
    size = staged.stat().st_size
    if size > max_bytes:
        raise _refuse(
            path, f"it is larger than the limit of {max_bytes} bytes", hint="Raise [limits] max_image_archive_bytes."
        )
    if done.exit_code != 0:
        err = done.err.strip()[-400:] or f"exit {done.exit_code}"
        if "Permission denied" in err:
            raise PermissionDenied(
                f"uid {uid} cannot read {path}: {err}; nothing was loaded",
                uid=uid,
                hint="crabd reads an image path with your own permissions: make it readable to you.",
            )
        raise ImageError(f"cannot read {path} as uid {uid}: {err}; nothing was loaded", env=path)
    return staged


# --- 2. the checks -----------------------------------------------------------------------------


def _members(tar: tarfile.TarFile, path: str) -> dict[str, tarfile.TarInfo]:
    """Every member by its name (``./`` stripped); refused: too many, or two with one name."""
    found: dict[str, tarfile.TarInfo] = {}
    for count, m in enumerate(tar, start=1):
        if count > MAX_MEMBERS:
            raise _refuse(path, f"it has more than {MAX_MEMBERS} members")
        name = m.name
        while name.startswith("./"):
            name = name[2:]
        name = name.rstrip("/")
        if name in found:
            raise _refuse(path, f"it has two members named {name[:200]!r}")
        found[name] = m
    return found


class _Reader:
    def __init__(self, tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], path: str) -> None:
        self.tar, self.members, self.path = tar, members, path

    def file(self, name: str) -> tarfile.TarInfo:
        m = self.members.get(name)
        if m is None or not m.isreg():
            raise _refuse(self.path, f"it has no regular file {name[:200]!r}")
        return m

    def stream(self, name: str) -> IO[bytes]:
        f = self.tar.extractfile(self.file(name))
        if f is None:  # a regular file always has one
            raise _refuse(self.path, f"cannot read {name[:200]!r}")
        return f

    def raw(self, name: str) -> bytes:
        m = self.file(name)
        if m.size > MAX_JSON_BYTES:
            raise _refuse(self.path, f"{name[:200]!r} is larger than {MAX_JSON_BYTES} bytes")
        with self.stream(name) as f:
            return f.read()

    def json(self, name: str, data: bytes | None = None) -> Any:
        try:
            return json.loads(self.raw(name) if data is None else data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _refuse(self.path, f"{name[:200]!r} is not JSON") from exc

    def blob(self, desc: object, what: str) -> tuple[str, bytes]:
        """An OCI descriptor's blob (member ``blobs/sha256/<hex>``), checked against its digest."""
        digest = desc.get("digest") if isinstance(desc, dict) else None
        if not isinstance(digest, str) or not IMAGE_DIGEST_RE.match(digest):
            raise _refuse(self.path, f"its {what} has no sha256 digest")
        name = "blobs/sha256/" + digest.removeprefix("sha256:")
        data = self.raw(name)
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise _refuse(self.path, f"its {what} {name} does not match its digest")
        return name, data


def _list(value: object, what: str, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise _refuse(path, f"{what} is not a list")
    return value


def _docker_save(r: _Reader) -> tuple[str, list[str]]:
    entries = _list(r.json("manifest.json"), "manifest.json", r.path)
    if len(entries) != 1 or not isinstance(entries[0], dict):
        raise _refuse(
            r.path, f"its manifest.json lists {len(entries)} images, not one", hint="`docker save` one image."
        )
    config, layers = entries[0].get("Config"), _list(entries[0].get("Layers"), "Layers", r.path)
    if not isinstance(config, str) or not all(isinstance(x, str) for x in layers):
        raise _refuse(r.path, "its manifest.json names no config or layers")
    return config.removeprefix("./"), [x.removeprefix("./") for x in layers]


def _oci(r: _Reader) -> tuple[str, list[str]]:
    found: list[Any] = []
    todo: list[tuple[Any, int]] = [(r.json("index.json"), 0)]
    while todo:
        index, depth = todo.pop()
        for desc in _list(index.get("manifests") if isinstance(index, dict) else None, "an index's manifests", r.path):
            kind = desc.get("mediaType") if isinstance(desc, dict) else None
            name, data = r.blob(desc, "manifest")
            if kind in _OCI_INDEX and depth < 2:
                todo.append((r.json(name, data), depth + 1))
            elif kind in _OCI_MANIFEST:
                found.append(r.json(name, data))
            else:
                raise _refuse(r.path, f"its index names a {str(kind)[:100]!r}")
    if len(found) != 1 or not isinstance(found[0], dict):
        raise _refuse(r.path, f"it holds {len(found)} images, not one", hint="Give an OCI layout of one image.")
    manifest = found[0]
    config, _ = r.blob(manifest.get("config"), "config")
    layers = []
    for desc in _list(manifest.get("layers"), "the manifest's layers", r.path):
        if not isinstance(desc, dict):
            raise _refuse(r.path, "a layer's descriptor is not an object")
        kind, digest = desc.get("mediaType"), desc.get("digest")
        if kind not in _LAYER_TYPES or not isinstance(digest, str) or not IMAGE_DIGEST_RE.match(digest):
            raise _refuse(r.path, f"a layer of type {str(kind)[:100]!r} (crab loads tar and tar+gzip layers)")
        name = "blobs/sha256/" + digest.removeprefix("sha256:")
        if r.file(name).size != desc.get("size", r.file(name).size):
            raise _refuse(r.path, f"layer {name} is not the size its manifest gives")
        layers.append(name)
    return config, layers


def plan(staged: Path, path: str) -> Plan:
    """The one image in the tar ``staged`` (copied from ``path``), every check of the module doc passed."""
    with open(staged, "rb") as f:
        head = f.read(4)
    if head[:2] == b"\x1f\x8b" or head == b"\x28\xb5\x2f\xfd":
        raise _refuse(path, "it is compressed", hint="Decompress it first (`docker save IMAGE > x.tar` is plain).")
    try:
        with tarfile.open(staged, "r:") as tar:
            r = _Reader(tar, _members(tar, path), path)
            if "manifest.json" in r.members:
                config, layers = _docker_save(r)
            elif "index.json" in r.members:
                config, layers = _oci(r)
            else:
                raise _refuse(path, "it has neither manifest.json (`docker save`) nor index.json (an OCI layout)")
            raw = r.raw(config)
            cfg = r.json(config, raw)
            diff_ids = cfg.get("rootfs", {}).get("diff_ids") if isinstance(cfg, dict) else None
            if not isinstance(diff_ids, list) or len(diff_ids) != len(layers) or not layers:
                raise _refuse(path, "its config's rootfs.diff_ids do not match its layers")
            if cfg.get("os", "linux") != "linux":
                raise _refuse(path, f"it is an image for {str(cfg.get('os'))[:40]!r}, not linux")
            for name in layers:
                r.file(name)
            return Plan("sha256:" + hashlib.sha256(raw).hexdigest(), config, tuple(layers))
    except (tarfile.TarError, EOFError) as exc:
        raise _refuse(path, f"it is not a tar archive ({exc})") from exc


# --- 3. the load -------------------------------------------------------------------------------


def _load_tar(staged: Path, p: Plan, out: Path) -> None:
    """A ``docker load`` archive of ``p``'s config and layers under crab's own manifest (module doc, step 3)."""
    hexdigest = p.digest.removeprefix("sha256:")
    layer_names = [f"layers/{i}/layer.tar" for i in range(len(p.layers))]
    manifest = json.dumps(
        [{"Config": "config.json", "RepoTags": [f"{LOADED_REPO}:{hexdigest}"], "Layers": layer_names}]
    ).encode()
    with tarfile.open(staged, "r:") as src, tarfile.open(out, "w:", format=tarfile.PAX_FORMAT) as dst:
        members = _members(src, str(staged))
        for name, data_from, size in [
            ("manifest.json", None, len(manifest)),
            ("config.json", p.config, members[p.config].size),
            *[(n, layer, members[layer].size) for n, layer in zip(layer_names, p.layers, strict=True)],
        ]:
            info = tarfile.TarInfo(name)
            info.size, info.mode = size, 0o644
            if data_from is None:
                dst.addfile(info, io.BytesIO(manifest))
            else:
                with src.extractfile(members[data_from]) as f:  # type: ignore[union-attr]  # regular files (plan)
                    dst.addfile(info, f)


def load(staged: Path, p: Plan, path: str, exists: Callable[[str], bool]) -> str:
    """Load ``p`` into Docker unless ``exists(digest)``; its digest."""
    if exists(p.digest):
        return p.digest
    out = staged.with_name("load.tar")
    try:
        _load_tar(staged, p, out)
        proc.run(["docker", "load", "-q", "-i", str(out)], timeout=_LOAD_TIMEOUT_S)
    except CommandError as exc:
        raise ImageError(f"Docker refused the image in {path}: {exc.message}; nothing was loaded", env=path) from exc
    finally:
        out.unlink(missing_ok=True)
    if not exists(p.digest):
        raise ImageError(f"Docker loaded {path}, but has no image {p.digest} after it", env=path)
    return p.digest


# --- all three ----------------------------------------------------------------------------------


@contextlib.contextmanager
def staging(root: Path) -> Iterator[Path]:
    """A fresh staging dir under ``root`` (0700 root), removed afterwards."""
    private_dir(root)
    d = root / f"{STAGE_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    d.mkdir(mode=0o700)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def remove_stale(root: Path) -> None:
    """Staging dirs of crabd processes that are gone (a crash mid-load)."""
    if not root.is_dir():
        return
    for d in root.iterdir():
        pid = d.name.removeprefix(STAGE_PREFIX).split("-", 1)[0]
        if not d.name.startswith(STAGE_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass


def load_as(path: str, uid: int, gid: int, root: Path, max_bytes: int, exists: Callable[[str], bool]) -> str:
    """The digest of the image at ``path`` (read as ``uid``/``gid``), loaded into Docker if it lacks it."""
    with staging(root) as d:
        staged = stage_as(path, uid, gid, d, max_bytes)
        return load(staged, plan(staged, path), path, exists)
