"""mountinfo lines parsed (crabd/util/mountinfo.py)."""

from __future__ import annotations

import os

from crabd.util import mountinfo

TEXT = """\
22 1 0:21 / /proc rw,relatime - proc proc rw
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:5 master:1 - cgroup2 cgroup2 rw,nsdelegate
50 23 0:30 /nested /mnt/mem\\040copy\\134x rw - cgroup cgroup rw,memory
not a mount line
70 23 x:31 / /bad rw - tmpfs tmpfs rw
"""


def test_fields_escapes_and_optional_fields() -> None:
    proc, unified, nested = mountinfo.parse(TEXT)  # the two lines it cannot read are skipped
    assert proc == mountinfo.Mount(22, 1, os.makedev(0, 21), "/", "/proc", "proc", "rw")
    assert (unified.fstype, unified.super_options) == ("cgroup2", "rw,nsdelegate")  # past two optional fields
    assert (nested.root, nested.point, nested.super_options) == ("/nested", "/mnt/mem copy\\x", "rw,memory")
