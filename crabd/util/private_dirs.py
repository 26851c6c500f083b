"""crab's own directories: made, and re-made at every start, so users outside group ``crab`` see nothing.

Their entries are named after sandbox and container ids (netns pins,
bundles, runc state, CNI results, CRIU logs), and a sandbox id is what an
attacker needs to aim at another tenant's history (crabd/trust/identity.py).
``mkdir(mode=...)`` sets the mode only of a directory it creates, and
``parents=True`` gives the parents the umask's mode (0755), so a directory
left by an older crabd, or one made as a parent, keeps a listable mode
unless its mode is set again: :func:`private_dir` does both, every time.

Modes:

* 0700 root: only crabd (root) uses it (state, netns, runc state, CNI cache).
* 0750 root:crab (:func:`crab_dir`): the directory holding the public
  socket; members of ``crab`` must traverse it to connect, and may list it
  (it holds only crab's fixed names).  0700 if the group does not exist.
  Only a directory that is crab's alone gets it (``/run/crab``, or one
  crabd makes): never a shared one a socket was configured in.
"""

from __future__ import annotations

import grp
import os
from pathlib import Path

#: The group whose members may use crabd (systemd/crab.sysusers).
CRAB_GROUP = "crab"
#: crab's runtime root: the default socket's directory, and the parent of netns/, runc/ and bundles/.
RUN_DIR = Path("/run/crab")


def private_dir(path: Path, mode: int = 0o700) -> Path:
    """``path`` made and set to ``mode``, whatever it was; returns it.

    Missing parents are made 0755, as ``mkdir -p`` would: they hold only
    crab's fixed names, and a parent may have to be traversed (the socket's).
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    path.mkdir(mode=mode, exist_ok=True)
    if (os.stat(path).st_mode & 0o7777) != mode:
        os.chmod(path, mode)
    return path


def crab_dir(path: Path) -> Path:
    """``path`` as 0750 root:crab (0700 root when there is no group ``crab``), made if missing."""
    try:
        gid = grp.getgrnam(CRAB_GROUP).gr_gid
    except KeyError:
        return private_dir(path, 0o700)
    private_dir(path, 0o750)
    st = os.stat(path)
    if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (0, gid):
        os.chown(path, 0, gid)
    elif os.geteuid() != 0 and st.st_gid != gid:
        os.chown(path, -1, gid)
    return path
