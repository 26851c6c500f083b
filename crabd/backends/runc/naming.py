"""Names and specs of crab's runc containers: ids ``<instance>-<sandbox>-<generation>``, a sandbox's OCI spec.

The id says which crabd instance made the container and for which sandbox,
also when nothing else of it survived (a create-only leftover): cleanup and
re-adoption go by it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from crabd.backends.runc import bundle
from crabd.backends.runc.idmap import IdRange
from crabd.backends.sandbox import sandbox_hostname
from crabd.errors import ContainerRuntimeError
from crabd.models import SandboxSpec

#: No "-": the id's first "-" ends the instance, so one instance's prefix is never another's.
INSTANCE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]{0,31}")
SANDBOX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
#: No "-" either: an id splits at its last "-" into sandbox and generation.
GENERATION_RE = re.compile(r"[A-Za-z0-9_]{1,16}")


# --- ids ---------------------------------------------------------------------------


def check_instance(instance: str) -> str:
    """``instance`` if it can prefix container ids; ContainerRuntimeError if not."""
    # "tmp-" starts the half-made entries of bundles and btrfs subvolumes.
    if not INSTANCE_RE.fullmatch(instance) or instance.lower() == "tmp":
        raise ContainerRuntimeError(
            f"{instance!r} cannot be a crabd instance id for runc containers "
            "(letters, digits and '_', at most 32; not 'tmp')",
            container="",
        )
    return instance


def container_id(instance: str, sandbox_id: str, generation: str) -> str:
    """The container id ``<instance>-<sandbox id>-<generation>``, its parts validated."""
    check_instance(instance)
    if not SANDBOX_RE.fullmatch(sandbox_id):
        raise ContainerRuntimeError(f"not a valid sandbox id for a runc container: {sandbox_id!r}", container="")
    if not GENERATION_RE.fullmatch(generation):
        raise ContainerRuntimeError(f"not a valid container generation: {generation!r}", container="")
    return f"{instance}-{sandbox_id}-{generation}"


def parse_id(instance: str, container_id: str) -> tuple[str, str] | None:
    """(sandbox id, generation) if ``container_id`` is a well-formed id of ``instance``; else None."""
    prefix = f"{instance}-"
    if not container_id.startswith(prefix):
        return None
    sandbox_id, sep, generation = container_id[len(prefix) :].rpartition("-")
    if not sep or not SANDBOX_RE.fullmatch(sandbox_id) or not GENERATION_RE.fullmatch(generation):
        return None
    return sandbox_id, generation


def owned(instance: str, names: Iterable[str]) -> set[str]:
    """The names that are well-formed container ids of ``instance``."""
    return {n for n in names if parse_id(instance, n) is not None}


# --- the sandbox's spec in OCI terms -----------------------------------------------------


def merge_env(image_env: Iterable[str], env_vars: Mapping[str, str]) -> tuple[str, ...]:
    """Docker's merge: the image's variables, each replaced by the sandbox's of the same name, then the rest.

    Not a plain concatenation: with a name twice, ``getenv`` finds the first.
    """
    merged: dict[str, str] = {}
    for entry in image_env:
        key, _, value = entry.partition("=")
        merged[key] = value
    merged.update(env_vars)
    return tuple(f"{k}={v}" for k, v in merged.items())


def container_spec(
    cid: str,
    sandbox_id: str,
    spec: SandboxSpec,
    *,
    image_env: Iterable[str],
    init_binary: Path,
    labels: Mapping[str, str],
    netns: Path,
    userns: IdRange | None = None,
) -> bundle.ContainerSpec:
    """What the bundle of sandbox ``sandbox_id``'s container ``cid`` says (the Docker backend's sandbox)."""
    return bundle.ContainerSpec(
        id=cid,
        netns=netns,
        init_binary=init_binary,
        env=merge_env(image_env, spec.env_vars),
        cwd=spec.workdir or "/",
        hostname=sandbox_hostname(spec, sandbox_id),
        networked=spec.network,
        cpus=spec.cpus,
        memory_bytes=spec.memory_bytes,
        pids=spec.pids,
        annotations=dict(labels),
        userns=userns,
    )
