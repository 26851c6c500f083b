"""Session state: capture, JSON, and re-application to a fresh bash."""

from __future__ import annotations

import dataclasses
import json

import pytest

from crabd.errors import SessionStateError
from crabd.runtime import session_state as ss
from tests.unit.bashproc import Bash

SETUP = r"""
mkdir -p '/tmp/crab st/a b' && cd '/tmp/crab st/a b'
export WEIRD=$'line1\nline2 "q" \'s\' = \xff\xfe'
export PLAIN=x=y
declare -A ASSOC=([key one]=v1 [k2]=$'v\n2')
declare -a SPARSE=([1]=a [7]=b)
declare -i NUM=41+1
declare -r FIXED=constant
lower=UPPER; declare -l lower
greet() { echo "hi $1"; }
export -f greet
shopt -s expand_aliases extglob globstar
alias say='echo said'
set -o pipefail
umask 027
trap 'echo bye' EXIT
pushd /usr >/dev/null; pushd /var >/dev/null; cd '/tmp/crab st/a b'
"""


def capture(b: Bash) -> ss.SessionState:
    return ss.parse_state(b.capture())


def test_round_trip_to_a_fresh_bash() -> None:
    a = Bash()
    b = Bash({"PATH": "/usr/bin:/bin", "HOME": "/root", "STRAY": "must go"})
    try:
        r = a.run(SETUP)
        assert r is not None and r.exit_code == 0, r and r.stderr
        state = capture(a)
        assert state.cwd == "/tmp/crab st/a b"
        assert state.env["WEIRD"].encode("utf-8", "surrogateescape").endswith(b"\xff\xfe")
        again = ss.SessionState.from_json(state.to_json())
        assert again == state
        r = b.run(ss.render_restore_script(again))
        assert r is not None, "bash died"
        assert r.exit_code == 0, r.stderr
        restored = capture(b)
        for f in dataclasses.fields(ss.SessionState):
            assert getattr(restored, f.name) == getattr(state, f.name), f.name
        behaviour = b.run('greet x; say; echo "${ASSOC[key one]}" $NUM ${SPARSE[7]} $lower; umask; echo ${STRAY:-gone}')
        assert behaviour is not None
        assert behaviour.stdout == b"hi x\nsaid\nv1 42 b UPPER\n0027\ngone\n"
    finally:
        a.close()
        b.close()


def test_missing_cwd_falls_back_to_root() -> None:
    state = ss.SessionState(cwd="/no/such/dir")
    b = Bash()
    try:
        r = b.run(ss.render_restore_script(state))
        assert r is not None and b"is gone" in r.stderr
        r2 = b.run("pwd")
        assert r2 is not None and r2.stdout == b"/\n"
    finally:
        b.close()


def test_garbage_is_refused() -> None:
    with pytest.raises(SessionStateError):
        ss.parse_state(b"not a capture")
    with pytest.raises(SessionStateError):
        ss.SessionState.from_json('{"no": "cwd"}')
    with pytest.raises(SessionStateError):
        ss.SessionState.from_json("[")


def test_bash_quote_is_exact() -> None:
    b = Bash()
    try:
        value = "a'b\\c\n\t" + b"\xff".decode("utf-8", "surrogateescape")
        r = b.run(f"printf %s {ss.bash_quote(value)}")
        assert r is not None and r.stdout == value.encode("utf-8", "surrogateescape")
    finally:
        b.close()


def test_state_json_is_the_fields_as_before() -> None:
    """to_json reads the fields in place (no deep copy); the text is what asdict gave, and it round-trips."""
    st = ss.SessionState(
        cwd="/tmp",
        env={"B": "2", "A": "ü"},
        variables={"X": "declare -- X=1"},
        exported_functions=["f"],
        dirstack=["/tmp", "/"],
        limits={"nofile": [1024, 4096]},
        fds=[{"fd": 3, "kind": "file", "target": "/x", "flags": 0, "pos": 0}],
    )
    text = st.to_json()
    before = {k: v for k, v in dataclasses.asdict(st).items() if k != "named"}  # no named sessions: no key
    assert text == json.dumps(before, sort_keys=True, ensure_ascii=True)
    assert ss.SessionState.from_json(text) == st


def _named(**over: object) -> dict[str, object]:
    obj: dict[str, object] = {"state": {"cwd": "/srv"}, "pid": 42, "pty": [30, 100], "uid": 1000, "gid": 1000}
    obj.update(over)
    return obj


def test_named_sessions_round_trip_and_their_pids_are_read_without_parsing_the_rest() -> None:
    capture = ss.NamedCapture(ss.SessionState(cwd="/srv", env={"K": "v"}), 42, (30, 100), 1000, None)
    st = ss.SessionState(cwd="/").with_named({"web": capture})
    text = st.to_json()
    back = ss.SessionState.from_json(text)
    assert back.named_captures() == {"web": capture}
    assert ss.named_pids(text) == {42} and ss.named_pids(ss.SessionState(cwd="/").to_json()) == frozenset()
    assert ss.named_pids(None) == frozenset() and ss.named_pids('{"named": 3}') == frozenset()


@pytest.mark.parametrize(
    "named",
    [
        {"../x": _named()},  # a name a request could not give
        {"a:b": _named()},
        {"web": _named(pid=-1)},
        {"web": _named(pid=None)},
        {"web": _named(uid="0")},
        {"web": _named(pty=[0, 80])},
        {"web": _named(pty=[24])},
        {"web": _named(state={"cwd": 3})},
        {"web": _named(state={"cwd": "/", "named": {}})},  # no nesting
        {"web": {**_named(), "extra": 1}},
        {"web": "not an object"},
    ],
)
def test_a_stored_state_with_a_bad_named_session_is_refused(named: dict[str, object]) -> None:
    """A stored state can come from an archive: every named entry is checked as it is read."""
    text = json.dumps({"cwd": "/", "named": named})
    with pytest.raises(SessionStateError):
        ss.SessionState.from_json(text)
