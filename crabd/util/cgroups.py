"""Finding a Docker container's cgroup and its processes on the host.

Docker puts a container at ``docker/<id>`` (cgroupfs driver) or
``system.slice/docker-<id>.scope`` (systemd driver), in every hierarchy;
on this host's hybrid layout the v2 tree is mounted at ``unified``.
Processes in child cgroups of the container belong to it too.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def container_cgroup(container_id: str, root: Path = CGROUP_ROOT) -> Path | None:
    """The container's cgroup v2 directory (or v1 freezer's, as a fallback)."""
    for base in (
        root / "unified" / "docker" / container_id,
        root / "docker" / container_id,
        root / "system.slice" / f"docker-{container_id}.scope",
        root / "freezer" / "docker" / container_id,
    ):
        if (base / "cgroup.procs").exists():
            return base
    return None


def cgroup_id(container_id: str, root: Path = CGROUP_ROOT) -> int | None:
    """The cgroup v2 id of the container (the inode of its directory), as BPF's helpers report it."""
    for base in (
        root / "unified" / "docker" / container_id,
        root / "docker" / container_id,
        root / "system.slice" / f"docker-{container_id}.scope",
    ):
        if (base / "cgroup.procs").exists():
            return base.stat().st_ino
    return None


def container_host_pids(container_id: str, root: Path = CGROUP_ROOT) -> list[int]:
    """Host pids of every process in the container's cgroup and its children."""
    base = container_cgroup(container_id, root)
    if base is None:
        return []
    out: list[int] = []
    for procs in [base / "cgroup.procs", *base.rglob("*/cgroup.procs")]:
        try:
            out.extend(int(x) for x in procs.read_text().split())
        except (OSError, ValueError):
            continue  # a child cgroup removed meanwhile
    return sorted(set(out))


def ns_pid(host_pid: int) -> tuple[int, str]:
    """(pid inside the container's pid namespace, command name) of a host pid; (0, "") if gone."""
    try:
        status = Path(f"/proc/{host_pid}/status").read_text()
    except OSError:
        return 0, ""
    name, nspid = "?", host_pid
    for row in status.splitlines():
        if row.startswith("Name:"):
            parts = row.split(None, 1)
            name = parts[1] if len(parts) > 1 else "?"
        elif row.startswith("NSpid:"):
            nspid = int(row.split()[-1])
    return nspid, name
