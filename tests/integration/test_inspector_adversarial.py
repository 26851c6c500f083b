"""The adversarial corpus against both inspectors: every restore must equal the live sandbox.

envs/inspector_corpus/adversarial holds turns that hide their writes from
path-based probes (``/dev/fd/../..``, directory fds, fds and mappings from
earlier turns, io_uring, times only, ...).  For every labelled turn,
bench/inspector_adversarial.py compares the live sandbox's files at the
turn end with a fork of the checkpoint standing for that turn; a difference,
a decision below the label or a failed checkpoint is a false negative.
False positives are only printed: these turns are built to be hard, not
typical (the labelled corpus's rate is test_inspector.py's business).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench import inspector_adversarial as adv
from bench.restored_state import LowerView, State, capture, diff
from crabd.sdk import Sandbox

pytestmark = [pytest.mark.bpf, pytest.mark.criu]


def test_the_corpus_covers_the_reported_bypasses() -> None:
    commands = {t.run for s in adv.load() for t in s.turns}
    for reported in (
        "echo x > /dev/pts/../../work/x",
        "echo y > /dev/fd/../../../work/y",
        "exec 5</work; echo z > /dev/fd/5/z",
        "exec 6>>/work/f",
        "echo data >&6; exec 6>&-",
        "touch -d 2001-01-01 /work/a",
    ):
        assert reported in commands


def _state(sb: Sandbox) -> tuple[State, LowerView]:
    merged, upper, lowers = adv.overlay(sb.info.container_id)
    return capture(merged, upper), LowerView(lowers)


def test_the_state_check_sees_what_a_restore_could_lose(make_sandbox: Callable[..., Sandbox]) -> None:
    # The checker itself must not be blind: content, a file too many or too few, an mtime, a
    # mode, an xattr, a link target, a hard link and an image file changed in place all show;
    # a read, an atime and a temp file come and gone (a directory's mtime) do not.
    sb = make_sandbox("bookworm")
    sb.session.run(
        "mkdir -p /work && cd /work && echo a > a && echo b > b && touch -d 2001-01-01 b && ln -s /x l && echo h > h"
    )
    before, lower = _state(sb)
    assert diff(before, before, lower) == []
    sb.session.run("cat a /etc/issue >/dev/null; touch -a -d 2002-02-02 a; touch tmp && rm tmp")
    assert diff(before, _state(sb)[0], lower) == []
    sb.session.run(
        "echo A > a; rm b; echo c > c; chmod 600 c; ln -sfn /y l; ln h h2; touch -d 2003-03-03 /etc/issue;"
        " python3 -c \"import os; os.setxattr('/etc/issue.net', 'user.k', b'v')\""
    )
    after, _ = _state(sb)
    found = diff(after, before, lower, most=50)
    text = "\n".join(found)
    for expected in (
        "/work/a: content differs",
        "/work/b: only in the restore",
        "/work/c: missing from the restore",
        "/work/l: points to b'/y' live, b'/x' restored",
        "/work/h: 2 links live, 1 restored",
        "/work/h2: missing from the restore",
        "/etc/issue: mtime 2003-03-03",
        "/etc/issue.net: xattrs",
    ):
        assert expected in text, text
    assert "/etc/issue: content" not in text  # copied up with the same bytes: compared with the image's
    assert diff(after, before, lower, times=False, most=50) == [x for x in found if "mtime" not in x]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ebpf", "scan"])
def test_every_restore_equals_the_live_sandbox(mode: str) -> None:
    scenarios = adv.load()
    assert sum(len(s.turns) for s in scenarios) >= 100
    results, seconds = adv.run_corpus(mode, scenarios, workers=4)
    s = adv.summarize(results)
    print("\n".join(adv.markdown(mode, s, seconds)))
    assert s["failed_commands"] == [], s["failed_commands"]  # a helper that broke tests nothing
    assert s["false_negatives"] == 0, "\n" + "\n".join(line for f in s["failures"] for line in adv.describe(f))
