"""Sandbox env images, built locally from recipes in ``envs/images/<name>/``.

No registry is involved: a recipe produces a root filesystem in a scratch
directory, which is packed and ``docker import``-ed.

Recipe format (``image.toml``)::

    name     = "<env name>"                 # what `crabctl create --env` takes
    builder  = "debootstrap" | "busybox"
    suite    = "bookworm"                   # debootstrap only
    variant  = "minbase"                    # debootstrap only
    mirror   = "http://deb.debian.org/debian"  # debootstrap only
    include  = ["pkg", ...]                 # debootstrap only

An optional ``rootfs/`` directory next to it is copied over the built tree.

Images are tagged by content: ``crab-env/<name>:<tag>`` where ``<tag>`` is the
first 16 hex digits of a SHA-256 over the recipe file, every file under
``rootfs/`` (path, mode, bytes) and :data:`BUILDER_VERSION`.  An image whose
tag exists is never rebuilt.  Images carry the labels ``dev.crab.env`` and
``dev.crab.recipe`` so crabd can find the current build of an env.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from crabd.errors import ImageError
from crabd.util import proc, resources

#: Bumped whenever the build procedure itself changes, to force rebuilds.
BUILDER_VERSION = "1"
REPO_PREFIX = "crab-env"
LABEL_ENV = "dev.crab.env"
LABEL_RECIPE = "dev.crab.recipe"

#: envs/images of the checkout, or its copy in the installed package (crabd/util/resources.py).
DEFAULT_RECIPES_DIR = resources.env_recipes_dir()


@dataclass(frozen=True)
class Recipe:
    name: str
    builder: str
    directory: Path
    suite: str = "bookworm"
    variant: str = "minbase"
    mirror: str = "http://deb.debian.org/debian"
    include: tuple[str, ...] = field(default_factory=tuple)

    @property
    def content_tag(self) -> str:
        h = hashlib.sha256()
        h.update(f"builder-version={BUILDER_VERSION}\n".encode())
        h.update((self.directory / "image.toml").read_bytes())
        overlay = self.directory / "rootfs"
        if overlay.is_dir():
            for path in sorted(overlay.rglob("*")):
                st = path.lstat()
                h.update(os.fsencode(path.relative_to(overlay)) + b"\0")
                h.update(f"{st.st_mode:o}\0".encode())
                if stat.S_ISREG(st.st_mode):
                    h.update(path.read_bytes())
                elif stat.S_ISLNK(st.st_mode):
                    h.update(os.fsencode(os.readlink(path)))
        return h.hexdigest()[:16]

    @property
    def image_ref(self) -> str:
        return f"{REPO_PREFIX}/{self.name}:{self.content_tag}"


def load_recipe(directory: Path) -> Recipe:
    path = directory / "image.toml"
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ImageError(f"cannot read image recipe {path}: {exc}", env=directory.name) from exc
    known = {"name", "builder", "suite", "variant", "mirror", "include"}
    unknown = set(data) - known
    if unknown:
        raise ImageError(f"{path}: unknown keys {sorted(unknown)}", env=directory.name)
    if data.get("builder") not in ("debootstrap", "busybox"):
        raise ImageError(f"{path}: builder must be 'debootstrap' or 'busybox'", env=directory.name)
    return Recipe(
        name=str(data.get("name", directory.name)),
        builder=str(data["builder"]),
        directory=directory,
        suite=str(data.get("suite", "bookworm")),
        variant=str(data.get("variant", "minbase")),
        mirror=str(data.get("mirror", "http://deb.debian.org/debian")),
        include=tuple(str(x) for x in data.get("include", [])),
    )


def list_recipes(recipes_dir: Path = DEFAULT_RECIPES_DIR) -> list[Recipe]:
    if not recipes_dir.is_dir():
        return []
    return [load_recipe(d) for d in sorted(recipes_dir.iterdir()) if (d / "image.toml").is_file()]


def find_recipe(name: str, recipes_dir: Path = DEFAULT_RECIPES_DIR) -> Recipe:
    for recipe in list_recipes(recipes_dir):
        if recipe.name == name:
            return recipe
    known = ", ".join(r.name for r in list_recipes(recipes_dir)) or "none"
    raise ImageError(f"no env called {name!r} (known envs: {known})", env=name)


def image_exists(ref: str) -> bool:
    done = proc.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], timeout=30, check=False)
    return done.exit_code == 0


def _build_rootfs_debootstrap(recipe: Recipe, rootfs: Path) -> None:
    argv = [
        "debootstrap",
        f"--variant={recipe.variant}",
        "--include=" + ",".join(recipe.include),
        recipe.suite,
        str(rootfs),
        recipe.mirror,
    ]
    proc.run(argv, timeout=1200)
    # Keep the image small and free of host-specific state.
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        target = rootfs / sub
        if target.is_dir():
            for child in target.iterdir():
                if child.is_file():
                    child.unlink()


def _build_rootfs_busybox(recipe: Recipe, rootfs: Path) -> None:
    busybox = shutil.which("busybox") or "/bin/busybox"
    if not os.path.exists(busybox):
        raise ImageError("busybox-static is not installed", env=recipe.name, hint="apt-get install busybox-static")
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "tmp", "proc", "sys", "dev", "root", "work"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    os.chmod(rootfs / "tmp", 0o1777)  # noqa: S103 - /tmp inside the image is world-writable and sticky
    shutil.copy2(busybox, rootfs / "bin" / "busybox")
    applets = proc.run([busybox, "--list-full"], timeout=30).out.split()
    for applet in applets:
        link = rootfs / applet
        if applet == "bin/busybox" or link.exists():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("/bin/busybox")
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")


def build(recipe: Recipe, *, force: bool = False) -> tuple[str, bool]:
    """Build ``recipe`` unless its content tag already exists.

    Returns ``(image_ref, built)``.
    """
    ref = recipe.image_ref
    if not force and image_exists(ref):
        return ref, False
    with tempfile.TemporaryDirectory(prefix=f"crab-image-{recipe.name}-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        rootfs.mkdir()
        if recipe.builder == "debootstrap":
            _build_rootfs_debootstrap(recipe, rootfs)
        else:
            _build_rootfs_busybox(recipe, rootfs)
        overlay = recipe.directory / "rootfs"
        if overlay.is_dir():
            shutil.copytree(overlay, rootfs, symlinks=True, dirs_exist_ok=True)
        tarball = Path(tmp) / "rootfs.tar"
        proc.run(["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(tarball), "."], timeout=600)
        proc.run(
            [
                "docker",
                "import",
                "--change",
                f"LABEL {LABEL_ENV}={recipe.name}",
                "--change",
                f"LABEL {LABEL_RECIPE}={recipe.content_tag}",
                "--change",
                'CMD ["/bin/sh"]',
                str(tarball),
                ref,
            ],
            timeout=600,
        )
    return ref, True


def remove_stale(recipe: Recipe) -> list[str]:
    """Remove older builds of ``recipe``'s env (other content tags)."""
    done = proc.run(
        [
            "docker",
            "image",
            "ls",
            "--filter",
            f"label={LABEL_ENV}={recipe.name}",
            "--format",
            "{{.Repository}}:{{.Tag}}",
        ],
        timeout=30,
    )
    stale = [ref for ref in done.out.split() if ref != recipe.image_ref and ref.startswith(f"{REPO_PREFIX}/")]
    for ref in stale:
        proc.run(["docker", "image", "rm", ref], timeout=60, check=False)
    return stale
