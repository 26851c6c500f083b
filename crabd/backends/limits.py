"""What every sandbox is held to, on either backend: its default pids limit and the capabilities it keeps.

A module of its own, below both backends: the runc backend reads them
without importing the Docker one (docker-py is ~65 ms of crabd's start-up,
which decides how soon crabd serves again after a crash).
"""

from __future__ import annotations

#: Default pids limit when the spec leaves it at 0: a fork bomb in a sandbox
#: must not exhaust the host's pid space.
DEFAULT_PIDS_LIMIT = 4096

#: The capabilities a sandbox keeps (everything else is dropped; see
#: docs/security.md, "Isolation", for why each one stays).  Docker's default
#: set less NET_RAW (forged packets, ARP spoofing on the shared bridge),
#: AUDIT_WRITE, SETFCAP, SETPCAP and SYS_CHROOT.  MKNOD stays: making a node
#: is harmless while Docker's device cgroup refuses to open all but the
#: standard character devices, and package installs and the store's own
#: tests make nodes.
SANDBOX_CAPABILITIES = (
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "SETGID",
    "SETUID",
    "NET_BIND_SERVICE",
)
