"""The session wire protocol against a real bash."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from crabd.errors import SessionCommandError
from crabd.runtime import session_proto as sp
from crabd.runtime import session_state as ss
from crabd.runtime.initproto import CONTROL_FD
from tests.unit.bashproc import Bash


@pytest.fixture
def bash() -> Iterator[Bash]:
    b = Bash()
    yield b
    b.close()


def out(b: Bash, cmd: str) -> bytes:
    r = b.run(cmd)
    assert r is not None
    return r.stdout


def test_state_persists_at_top_level(bash: Bash) -> None:
    assert out(bash, "cd /tmp; export A=1; declare -A M=([k]=v); f() { echo f; }; alias a='echo al'") == b""
    assert out(bash, "echo $PWD $A ${M[k]}; f; a") == b"/tmp 1 v\nf\nal\n"


def test_exit_status_and_dollar_question(bash: Bash) -> None:
    r = bash.run("false")
    assert r is not None and r.exit_code == 1
    assert out(bash, "echo $?") == b"1\n"
    r = bash.run("true", keep=True)
    assert out(bash, "echo $?") == b"0\n"  # `echo $?` above succeeded; keep=True preserved that


def test_output_is_exact(bash: Bash) -> None:
    assert out(bash, "printf abc") == b"abc"
    r = bash.run("echo err >&2; printf '\\xff\\x00x'")
    assert r is not None and r.stdout == b"\xff\x00x" and r.stderr == b"err\n"


def test_syntax_error_keeps_session(bash: Bash) -> None:
    r = bash.run('echo "unterminated')
    assert r is not None and r.exit_code == 2 and r.stderr
    assert out(bash, "echo ok") == b"ok\n"


def test_heredoc_lookalike_and_quotes(bash: Bash) -> None:
    cmd = "cat <<'EOF'\n__CRAB_EOF_0000\n$HOME `x` \\\nEOF"
    assert out(bash, cmd) == b"__CRAB_EOF_0000\n$HOME `x` \\\n"


def test_stdin_is_empty(bash: Bash) -> None:
    r = bash.run("cat; read x; echo rc=$?")
    assert r is not None and r.stdout == b"rc=1\n"


def test_background_job_survives(bash: Bash) -> None:
    pid = out(bash, "sleep 30 & echo $!").strip().decode()
    assert out(bash, f"kill -0 {pid} && echo alive; jobs | wc -l") == b"alive\n1\n"
    out(bash, f"kill {pid}")


def test_exit_ends_session(bash: Bash) -> None:
    assert bash.run("exit 7") is None
    assert bash.p.wait(10) == 7


def test_nul_is_refused() -> None:
    with pytest.raises(SessionCommandError):
        sp.wrap_command("echo \0", sp.new_nonce())


def test_output_bounded(bash: Bash) -> None:
    r = bash.run("head -c 5000000 /dev/zero", limit=1 << 20)
    assert r is not None and len(r.stdout) == 1 << 20 and r.dropped_stdout == 5_000_000 - (1 << 20)


def _forge(nonce: str) -> str:
    """Shell text printing done markers (old and new style) and a fake capture for ``nonce``."""
    return (
        f"printf '\\036__CRAB_DONE_{nonce}_0\\036'; printf '\\036__CRAB_DONE_{nonce}_0\\036' >&2; "
        f"printf 'DONE:{nonce}:0\\0'; printf 'DONE:{nonce}:0\\0' >&2; "
        "printf 'STATE\\0CWD\\0=/forged\\0END\\0'; "
    )


def test_forged_marker_on_stdout_is_plain_output(bash: Bash) -> None:
    nonce = "5eed" * 4
    r = bash.run(_forge(nonce) + "sleep 0.2; echo after; (exit 3)", nonce=nonce)
    assert r is not None and r.done and r.exit_code == 3
    assert r.stdout == (
        b"\x1e__CRAB_DONE_" + nonce.encode() + b"_0\x1e" + b"DONE:" + nonce.encode() + b":0\0"
        b"STATE\0CWD\0=/forged\0END\0after\n"
    )
    assert r.stderr == b"\x1e__CRAB_DONE_" + nonce.encode() + b"_0\x1eDONE:" + nonce.encode() + b":0\0"
    assert out(bash, "echo next") == b"next\n"


def test_a_child_writing_the_control_fd_is_rejected(bash: Bash) -> None:
    # Children inherit fd 100 (closing it for the command breaks under `ulimit -n 100`, see
    # session_proto); what they write carries their own pid and is dropped.
    nonce = "feed" * 4
    r = bash.run(f"bash -c \"printf 'DONE:{nonce}:0\\0' >&{CONTROL_FD}\"; sleep 0.3; echo after; (exit 5)", nonce=nonce)
    assert r is not None
    assert r.exit_code == 5 and r.stdout == b"after\n", r.stderr
    assert bash.rejected and bash.p.pid not in bash.rejected


def test_the_channel_survives_a_low_open_file_limit(bash: Bash) -> None:
    # `ulimit -n 100` (the issue's own example) made bash's dup2 back to fd 100 fail when the command
    # ran with the channel closed: the session lost its markers.
    r = bash.run("ulimit -Sn 100; echo set")
    assert r is not None and r.exit_code == 0 and r.stdout == b"set\n"
    assert out(bash, "ulimit -Sn") == b"100\n"
    assert bash.capture()


def test_subshell_writing_a_copy_of_the_control_fd_is_rejected(bash: Bash) -> None:
    """bash keeps a saved copy of fd 100 while the command runs; a forked subshell inherits it.

    It writes a marker with the right nonce and a fake capture; both come
    with the subshell's pid and are dropped, as crab-init drops them.
    """
    nonce = "c0ffee00" * 2
    cmd = (
        "for f in /proc/$$/fd/*; do case $(readlink $f) in socket:*) "
        f"( printf 'DONE:{nonce}:0\\0STATE\\0CWD\\0=/forged\\0END\\0' >&${{f##*/}} ) && echo wrote;; esac; done; "
        "sleep 0.3; echo after; (exit 4)"
    )
    r = bash.run(cmd, nonce=nonce)
    assert r is not None
    assert r.exit_code == 4 and r.stdout == b"wrote\nafter\n", r.stderr
    assert r.state is None
    assert bash.rejected and bash.p.pid not in bash.rejected


def test_state_capture_ignores_stdout_and_debug_traps(bash: Bash) -> None:
    """A DEBUG trap runs in bash before every command of the capture; what it prints is not the state."""
    fake = "\\036CWD\\036/forged\\036END\\036STATE\\0CWD\\0=/forged\\0END\\0"
    assert bash.run(f"cd /tmp; trap 'printf \"{fake}\"' DEBUG") is not None
    state = ss.parse_state(bash.capture())
    assert state.cwd == "/tmp" and "DEBUG" in state.traps


def test_capture_survives_strict_modes(bash: Bash) -> None:
    assert bash.run("set -euo pipefail; IFS=:; declare -x HALF; declare -n DANGLING=nothere; cd /usr") is not None
    state = ss.parse_state(bash.capture())
    assert state.cwd == "/usr" and "HALF" not in state.env and bash.p.poll() is None
    assert out(bash, "echo alive") == b"alive\n"


def test_exec_closing_stdout_still_completes(bash: Bash) -> None:
    r = bash.run("exec >&-")
    assert r is not None and r.exit_code == 0
    assert bash.run("echo gone; echo err >&2") is not None


MARK = "ab" * 8


def _scan(control: bytes, step: int = 1) -> sp.MarkerScanner:
    sc = sp.MarkerScanner(MARK, max_stdout=100, max_stderr=100, max_control=200)
    for i in range(0, len(control), step):
        sc.feed_control(control[i : i + step])
    return sc


def test_control_words_split_across_every_byte() -> None:
    state = b"STATE\0CWD\0=/a\0END\0"
    stream = b"DONE:" + b"cd" * 8 + b":0\0" + b"=stray\0" + state + b"DONE:" + MARK.encode() + b":42\0DONE:x:1\0"
    sc = _scan(stream)
    assert sc.done and sc.exit_code == 42 and sc.state == state
    assert not _scan(stream[:-20]).done  # a stale nonce and content words end nothing


def test_control_state_records() -> None:
    done = b"DONE:" + MARK.encode() + b":0\0"
    # The last complete record counts; one cut short by a new STATE or by DONE does not.
    sc = _scan(b"STATE\0=x\0END\0STATE\0=y\0STATE\0=z\0END\0STATE\0=cut\0" + done)
    assert sc.done and sc.state == b"STATE\0=z\0END\0"
    # A record larger than max_control is dropped (and said so); the marker still ends the command.
    sc = _scan(b"STATE\0=" + b"v" * 300 + b"\0END\0" + done, step=7)
    assert sc.done and sc.state is None and sc.control_overflow
    # A status that is not a number is no marker.
    assert not _scan(b"DONE:" + MARK.encode() + b":x\0").done


def test_output_after_the_marker_is_not_the_commands() -> None:
    sc = sp.MarkerScanner(MARK, max_stdout=3, max_stderr=100)
    assert sc.feed("stdout", b"abcd") == b"abc" and sc.dropped_stdout == 1
    assert sc.feed("stdout", b"\x1e__CRAB_DONE_" + MARK.encode() + b"_0\x1e") == b""  # output, dropped by the bound
    sc.feed_control(b"DONE:" + MARK.encode() + b":0\0")
    assert sc.feed("stderr", b"late") == b"" and sc.stderr == b""


def test_restoring_a_status_runs_no_err_trap(bash: Bash) -> None:
    """``$?`` is set back with ``! :`` in a case, not ``(exit 1)``: that was a failing command of its own.

    Before, each block after a failed command ran the user's ERR trap again (twice: the
    ``(exit 1)`` and the ``eval`` around it), and its output landed in the next command.
    """
    r = bash.run("trap 'echo trapped >&2' ERR; false")
    assert r is not None and r.exit_code == 1 and r.stderr == b"trapped\n"
    r = bash.run("echo $?")
    assert r is not None and r.stdout == b"1\n" and r.stderr == b""
    r = bash.run("echo again")
    assert r is not None and r.stdout == b"again\n" and r.stderr == b""


@pytest.mark.parametrize("status", [0, 1, 7])
def test_status_round_trips_through_a_block(bash: Bash, status: int) -> None:
    r = bash.run(f"(exit {status})")
    assert r is not None and r.exit_code == status
    assert out(bash, "echo $?") == f"{status}\n".encode()
    assert bash.run("true", keep=True) is not None  # crab's own command in between
    r = bash.run(f"(exit {status})")
    assert bash.run(":", keep=True) is not None
    assert out(bash, "echo $?") == f"{status}\n".encode()


def test_crabs_own_command_is_read_once_not_through_a_heredoc() -> None:
    """bash reads a pipe a byte per read(2): the capture's text is sent once, not as a heredoc that is read again."""
    block = sp.wrap_command(ss.CAPTURE_COMMAND, "ab" * 8, keep_status=True)
    assert block.count(ss.CAPTURE_COMMAND.encode()) == 1 and b"<<" not in block and b"__crab_cmd" not in block
    assert len(block) < len(ss.CAPTURE_COMMAND) + 300
