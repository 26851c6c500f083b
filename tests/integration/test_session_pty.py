"""pty sessions against a real crabd: a terminal for output, exact bytes, order kept, and through checkpoints."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest

from crabd.sdk import EmbeddedDaemon, Sandbox
from tests.integration import conftest
from tests.integration.conftest import daemon_with_config

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu]


@pytest.fixture(scope="module", params=conftest.BACKENDS)
def daemon(request: pytest.FixtureRequest) -> Iterator[EmbeddedDaemon]:
    """Each backend: Docker's devpts and runc's (in a user namespace) both hold the terminal through CRIU."""
    with daemon_with_config(conftest.backend_toml(request.param, "crabpty"), "crabpty") as d:
        yield d


# Commands read an empty stdin in every session; the terminal is the controlling one (/dev/tty).
PROBE = "[ -t 1 ] && echo out-tty; [ -t 2 ] && echo err-tty; [ -t 0 ] || echo in-null; stty size </dev/tty; tty <&1"


def _probe(sb: Sandbox, name: str) -> list[str]:
    r = sb.session(name).run(PROBE)
    assert r.exit_code == 0 and r.stderr == b"", r
    return r.stdout.decode().splitlines()


def test_a_pty_session_is_a_terminal_of_its_size_with_one_stream(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    info = sb.session("term").open(pty=(30, 100))
    assert info.pty == (30, 100)
    lines = _probe(sb, "term")
    assert lines[:4] == ["out-tty", "err-tty", "in-null", "30 100"] and re.fullmatch(r"/dev/pts/\d+", lines[4])
    # One interleaved stream, in the order written, bytes exact (raw mode: no "\r\n", no echo).
    r = sb.session("term").run("printf 'a\\n'; echo b >&2; printf 'c\\r\\n\\x01'")
    assert (r.stdout, r.stderr, r.exit_code) == (b"a\nb\nc\r\n\x01", b"", 0)
    # The other kinds are unchanged: a plain named session and the default one have pipes.
    assert sb.session("plain").run("[ -t 1 ] || echo pipe").stdout == b"pipe\n"
    assert sb.session.run("[ -t 1 ] || echo pipe").stdout == b"pipe\n"
    listed = {s.name: s.pty for s in sb.sessions()}
    assert listed["term"] == (30, 100) and listed["plain"] is None and listed[""] is None
    # True: the default size.
    assert sb.session("small").open(pty=True).pty == (24, 80)


def test_each_commands_output_is_its_own_however_big(make_sandbox: Callable[..., Sandbox]) -> None:
    """The done marker comes on another channel than a pty's output: nothing of one command leaks into the next."""
    sb = make_sandbox("bookworm")
    sb.session("term").open(pty=True)
    for i in range(12):
        n = 1 + (i * 37_111) % 300_000
        r = sb.session("term").run(f"head -c {n} /dev/zero | tr '\\0' x; echo END{i}")
        assert r.stdout == b"x" * n + f"END{i}\n".encode(), (i, len(r.stdout), r.stdout[-20:])


def test_a_pty_session_comes_back_from_checkpoint_restore_and_fork(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    sb.session("term").open(pty=(40, 120))
    sb.session("term").run("export MARK=one; sleep 1000 & JOB=$!")
    ck = sb.checkpoint("pty session")
    assert ck.kind == "full"
    sb.session("term").run("export MARK=two; kill $JOB")
    sb.restore(ck.id)
    for target in (sb,):
        assert target.session("term").run("echo $MARK; kill -0 $JOB && echo alive").stdout == b"one\nalive\n"
        assert _probe(target, "term")[:4] == ["out-tty", "err-tty", "in-null", "40 120"]
    with sb.fork(1, ck.id) as forks:
        fork = forks[0]
        assert fork.session("term").run("echo $MARK; kill -0 $JOB && echo alive").stdout == b"one\nalive\n"
        assert _probe(fork, "term")[:4] == ["out-tty", "err-tty", "in-null", "40 120"]
        assert {s.name: s.pty for s in fork.sessions()}["term"] == (40, 120)
