"""What a CRIU failure's error message quotes from CRIU's log (``backends/criu/runc.py``)."""

from __future__ import annotations

from pathlib import Path

from crabd.backends.criu.runc import log_excerpt

LOG = """\
(00.100000) Collected 12 sockets
(00.101000) Error (criu/util.c:1): Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.212400) unix: \tRunaway socket: ino 4801231 peer_ino 4801230 family    1 type    1 state  1 name (null)
(00.212497) Error (criu/sk-unix.c:874): unix: External socket is used. Consider using --ext-unix-sk option.
(00.213661) Error (criu/cr-dump.c:1975): Dumping FAILED.
(00.213700) Unlock network
(00.213800) Unfreezing tasks into 1
"""


def test_an_external_socket_failure_names_the_socket_outside_the_dump(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text(LOG)
    excerpt = log_excerpt(log).splitlines()
    assert "Runaway socket: ino 4801231 peer_ino 4801230" in excerpt[0]
    assert "External socket is used" in excerpt[1] and "Dumping FAILED" in excerpt[2]
    assert not any("RLIMIT_NOFILE" in line for line in excerpt)  # noise CRIU logs on every run here
    assert excerpt[-1].endswith("Unfreezing tasks into 1")


def test_an_unreadable_log_gives_no_excerpt(tmp_path: Path) -> None:
    assert log_excerpt(tmp_path / "missing.log") == ""
