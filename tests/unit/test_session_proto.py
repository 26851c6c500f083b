"""The session wire protocol against a real bash."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from crabd.errors import SessionCommandError
from crabd.runtime import session_proto as sp
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


def test_marker_split_across_every_byte() -> None:
    nonce = "ab" * 8
    sc = sp.MarkerScanner(nonce, max_stdout=100, max_stderr=100)
    stream = (
        b"out\x1e__CRAB_DONE_" + nonce.encode() + b"_x\x1e more \x1e__CRAB_DONE_" + nonce.encode() + b"_42\x1elater"
    )
    got = b""
    for i in range(len(stream)):
        got += sc.feed("stdout", stream[i : i + 1])
    sc.feed("stderr", b"\x1e__CRAB_DONE_" + nonce.encode() + b"_42\x1e")
    assert sc.done and sc.exit_code == 42
    # A lookalike with a non-numeric status is output; bytes after the marker are not.
    assert got == sc.stdout == b"out\x1e__CRAB_DONE_" + nonce.encode() + b"_x\x1e more "
