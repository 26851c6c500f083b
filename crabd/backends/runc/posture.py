"""A runc container's posture (procdump.Posture) read from its OCI config: what the restore check compares with.

Read from the same ``config.json`` object that the bundle is written from
(:func:`crabd.backends.runc.bundle.config`), so what a restored process may
hold is exactly what a freshly started one gets:

* capabilities: ``process.capabilities.bounding``;
* no_new_privs: ``process.noNewPrivileges``; a filter: ``linux.seccomp`` set,
  refusing at least the syscalls its rules refuse whatever the arguments;
* namespaces: ``linux.namespaces`` (OCI names mapped to CRIU's; one joined by
  path, like the network namespace, is still the sandbox's own);
* binds (the external mounts runc names to CRIU by destination): the bind
  mounts; and ``/dev/null``, which runc binds over each masked file; and, in
  a user namespace, the device nodes: a process there may not mknod, so runc
  binds each device (its default set and ``linux.devices``) from the host's
  node of the same path instead of creating it;
* masked directories: ``linux.maskedPaths``, where a restore may put crab's
  empty read-only tmpfs (masks.py);
* tmpfs points: where the spec mounts a tmpfs, or a cgroup tree (runc's
  tmpfs on cgroup v1), a restore may put a fresh tmpfs of the sandbox's root
  (tmpfs_copies.py);
* read-only points: ``linux.readonlyPaths`` and every ``ro`` mount but
  runc's cgroup mount (a writable tmpfs holding read-only controller mounts,
  which the check requires read-only by type);
* the user namespace's maps: ``linux.uidMappings``/``gidMappings``.
"""

from __future__ import annotations

from typing import Any

from crabd.backends.procdump import IdMap, Posture, capability_mask

#: OCI namespace type -> CRIU's kind.
_KINDS = {
    "pid": "pid",
    "network": "net",
    "ipc": "ipc",
    "uts": "uts",
    "mount": "mnt",
    "user": "user",
    "cgroup": "cgroup",
    "time": "time",
}


def _maps(entries: Any) -> tuple[IdMap, ...]:
    return tuple(IdMap(int(e["containerID"]), int(e["hostID"]), int(e["size"])) for e in entries or ())


#: OCI seccomp actions that refuse a syscall.
_REFUSING = {"SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL_THREAD", "SCMP_ACT_TRAP"}


def refused_syscalls(seccomp: dict[str, Any] | None) -> frozenset[str]:
    """The syscalls an OCI seccomp object refuses whatever their arguments."""
    if not seccomp:
        return frozenset()
    if seccomp.get("defaultAction") in _REFUSING:
        raise ValueError("an allow-list seccomp profile: name what it refuses some other way")
    names: set[str] = set()
    for rule in seccomp.get("syscalls") or ():
        if rule.get("action") in _REFUSING and not rule.get("args"):
            names.update(rule.get("names") or ())
    return frozenset(names)


#: The devices runc 1.1 gives every container (libcontainer/specconv's AllowedDevices that have a path).
RUNC_DEFAULT_DEVICES = frozenset({"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"})


def posture_of(config: dict[str, Any]) -> Posture:
    """The posture an OCI config grants its container's processes."""
    process = config.get("process") or {}
    linux = config.get("linux") or {}
    mounts = config.get("mounts") or []
    binds = {m["destination"] for m in mounts if m.get("type") == "bind" or "rbind" in (m.get("options") or ())}
    namespaces = frozenset(_KINDS[n["type"]] for n in linux.get("namespaces") or ())
    if "user" in namespaces:
        binds |= RUNC_DEFAULT_DEVICES | {d["path"] for d in linux.get("devices") or ()}
    readonly = set(linux.get("readonlyPaths") or ())
    readonly |= {m["destination"] for m in mounts if "ro" in (m.get("options") or ()) and m.get("type") != "cgroup"}
    return Posture(
        capabilities=capability_mask((process.get("capabilities") or {}).get("bounding") or ()),
        no_new_privs=bool(process.get("noNewPrivileges")),
        seccomp_filter=bool(linux.get("seccomp")),
        refused_syscalls=refused_syscalls(linux.get("seccomp")),
        namespaces=namespaces,
        binds=frozenset(binds),
        mask_binds=frozenset({"/dev/null"}) if linux.get("maskedPaths") else frozenset(),
        mask_dirs=frozenset(linux.get("maskedPaths") or ()),
        tmpfs_points=frozenset(m["destination"] for m in mounts if m.get("type") in ("tmpfs", "cgroup")),
        readonly=frozenset(readonly),
        uid_map=_maps(linux.get("uidMappings")),
        gid_map=_maps(linux.get("gidMappings")),
    )
