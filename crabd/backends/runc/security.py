"""A sandbox's security posture in OCI terms: the Docker backend's, written out.

The Docker backend gets most of its posture from dockerd's defaults; a runc
bundle gets only what its ``config.json`` says, so each piece is spelled
out here (docs/runc.md compares the two):

* capabilities: the Docker backend's trimmed set
  (:data:`~crabd.backends.limits.SANDBOX_CAPABILITIES`) as the
  bounding, effective and permitted sets; inheritable and ambient empty
  (nothing is passed on across an exec of a non-root program);
* ``noNewPrivileges``, as the Docker backend's ``no-new-privileges``;
* the kernel interfaces that Docker and runc hide (masked) or make
  read-only under ``/proc`` and ``/sys``;
* a seccomp filter that refuses what Docker's default profile refuses to a
  container without CAP_SYS_ADMIN: new namespaces (``unshare``, ``setns``,
  ``clone`` with a CLONE_NEW* flag), the kernel keyring, module loading,
  BPF, perf, kexec, userfaultfd and handle-based opens, among others; and,
  as to a container without CAP_SYS_PTRACE, ``process_vm_readv/writev``.
  It is a deny list (Docker's is an allow list): the dropped capabilities
  already refuse most of what an allow list would add;
* devices: the cgroup's device list denies all, and runc adds back its
  standard character devices (null, zero, full, random, urandom, tty,
  ptmx and the pts), as Docker does.
"""

from __future__ import annotations

from typing import Any

#: Shared with the Docker backend (not copied): both grant exactly these.
from crabd.backends.limits import SANDBOX_CAPABILITIES

#: Paths made unreadable (runc and Docker's defaults).
MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)

#: Paths made read-only (runc and Docker's defaults).
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")

#: Open files per process: what Docker's containers get on this host kind
#: (dockerd's own limit, measured with `ulimit -n` in a container).
NOFILE_LIMIT = 20000

_EPERM = 1
_ENOSYS = 38

#: Syscalls refused outright (EPERM).
DENIED_SYSCALLS = (
    "acct",
    "add_key",
    "bpf",
    "delete_module",
    "fanotify_init",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "init_module",
    "ioperm",
    "iopl",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "mount_setattr",
    "move_mount",
    "name_to_handle_at",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "process_vm_readv",
    "process_vm_writev",
    "pivot_root",
    "quotactl",
    "reboot",
    "request_key",
    "setns",
    "swapoff",
    "swapon",
    "syslog",
    "umount2",
    "unshare",
    "uselib",
    "userfaultfd",
    "vm86",
    "vm86old",
)

#: CLONE_NEW* flags: clone() with any of them is refused (Docker's profile
#: allows clone only when (flags & 0x7E020000) == 0).
CLONE_NS_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)


def capabilities() -> dict[str, list[str]]:
    """The OCI ``process.capabilities`` object."""
    caps = [f"CAP_{c}" for c in SANDBOX_CAPABILITIES]
    return {"bounding": caps, "effective": caps, "permitted": caps, "inheritable": [], "ambient": []}


def seccomp() -> dict[str, Any]:
    """The OCI ``linux.seccomp`` object (see the module's docstring)."""
    rules: list[dict[str, Any]] = [
        {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": _EPERM},
        # clone3 passes its flags in memory, out of seccomp's reach: ENOSYS
        # makes libc fall back to clone(), whose flags the rules below see.
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": _ENOSYS},
    ]
    # Rules on one syscall are ORed, conditions within a rule ANDed: one rule per flag.
    rules += [
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": _EPERM,
            "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        }
        for flag in CLONE_NS_FLAGS
    ]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": rules,
    }


def rlimits() -> list[dict[str, Any]]:
    """The OCI ``process.rlimits`` list."""
    return [{"type": "RLIMIT_NOFILE", "hard": NOFILE_LIMIT, "soft": NOFILE_LIMIT}]
