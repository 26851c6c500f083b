"""Where crab's shipped data files are: inside the installed package, else in the checkout.

crabd needs a few files that are not Python modules.  Their source of truth
stays at the repository's top level, and a build (wheel, sdist, or a plain
``pip install .``) lays a copy of each into the package, under ``crabd/_data/``
at the same relative path (``setup.py``'s ``build_py`` hook copies
:data:`SHIPPED`; ``MANIFEST.in`` puts the same files in the sdist)::

    checkout (editable install)        installed package (wheel)
    ebpf/inspector.c                   crabd/_data/ebpf/inspector.c
    envs/images/<env>/...              crabd/_data/envs/images/<env>/...
    scripts/setup-host.sh              crabd/_data/scripts/setup-host.sh
    systemd/crabd.service              crabd/_data/systemd/crabd.service
    systemd/crab.sysusers              crabd/_data/systemd/crab.sysusers
    systemd/crab.tmpfiles              crabd/_data/systemd/crab.tmpfiles
    crabd/runtime/init/crab-init.c     (the same: ordinary package data)

Every lookup of one of these goes through :func:`path`: where ``crabd/_data``
exists this is an installed package and the copy there is used; otherwise
(an editable install of a checkout) the checkout's own file is.

crab-init, the sandboxes' static PID 1, is shipped as its C source only and
compiled on the host that runs it (``crabctl host setup``; ``make`` in a
checkout).  A wheel is built on one host and installed on another, and it is
``py3-none-any``: a static x86-64 binary inside it would tie it to one
architecture under a tag that claims none, so the binary is never packaged.
Where it goes (:func:`crab_init_binary`):

* checkout: ``crabd/runtime/init/crab-init`` (the Makefile's target), rebuilt
  when older than its source;
* installed: ``/opt/crab/lib/crab-init-<sha256(source)[:12]>`` (root-owned,
  read-only to crabd under its unit; ``$CRAB_LIB_DIR`` moves the directory).
  The name carries the source's hash, so an upgrade that changes the source
  needs a new build, an unchanged one does not, and two installs of
  different versions never overwrite each other's binary.

This module must import nothing but the standard library: ``setup.py`` loads
it by path at build time, before crabd or its dependencies are installed.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: The ``crabd`` package directory.
PACKAGE = Path(__file__).resolve().parents[1]
#: Where a build lays the shipped files inside the package.
DATA_DIR = PACKAGE / "_data"
#: The checkout's root, when this is one (meaningless for an installed package).
CHECKOUT = PACKAGE.parent

#: Repository paths (files, or directories taken whole) copied into :data:`DATA_DIR` at build time.
SHIPPED: tuple[str, ...] = (
    "ebpf/inspector.c",
    "envs/images",
    "scripts/setup-host.sh",
    "systemd/crabd.service",
    "systemd/crab.sysusers",
    "systemd/crab.tmpfiles",
)

#: crab-init's C source, package data in both layouts.
CRAB_INIT_SOURCE = PACKAGE / "runtime" / "init" / "crab-init.c"
#: Where ``crabctl host setup`` compiles crab-init for an installed package.
DEFAULT_LIB_DIR = Path("/opt/crab/lib")


def installed() -> bool:
    """True for an installed package (it carries :data:`DATA_DIR`), False for a checkout."""
    return DATA_DIR.is_dir()


def path(rel: str) -> Path:
    """The shipped file or directory ``rel`` (one of :data:`SHIPPED`, or a path under one)."""
    if not any(rel == s or rel.startswith(s + "/") for s in SHIPPED):
        raise ValueError(f"{rel!r} is not a shipped data file (crabd.util.resources.SHIPPED)")
    return (DATA_DIR if installed() else CHECKOUT) / rel


def inspector_program() -> Path:
    """The eBPF inspector's C source."""
    return path("ebpf/inspector.c")


def env_recipes_dir() -> Path:
    """The directory of sandbox image recipes (``<env>/image.toml``)."""
    return path("envs/images")


def setup_script() -> Path:
    """The host set-up script (``make host`` and ``crabctl host setup`` run this one)."""
    return path("scripts/setup-host.sh")


def systemd_file(name: str) -> Path:
    """``crabd.service``, ``crab.sysusers`` or ``crab.tmpfiles``."""
    return path(f"systemd/{name}")


def crab_init_source() -> Path:
    return CRAB_INIT_SOURCE


def lib_dir() -> Path:
    """Where an installed package's crab-init binary lives."""
    return Path(os.environ.get("CRAB_LIB_DIR") or DEFAULT_LIB_DIR)


def crab_init_binary() -> Path:
    """Where crab-init's binary is (or is to be built) for this layout; see the module doc."""
    if not installed():
        return CRAB_INIT_SOURCE.with_name("crab-init")
    digest = hashlib.sha256(CRAB_INIT_SOURCE.read_bytes()).hexdigest()[:12]
    return lib_dir() / f"crab-init-{digest}"
