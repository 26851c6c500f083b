from __future__ import annotations

import sys

import pytest

from crabd.errors import CommandError, CommandTimeout
from crabd.util import proc


def test_success_captures_output() -> None:
    done = proc.run([sys.executable, "-c", "print('hi')"], timeout=30)
    assert done.exit_code == 0
    assert done.out == "hi\n"


def test_failure_keeps_stderr_and_exit_code() -> None:
    with pytest.raises(CommandError) as info:
        proc.run([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"], timeout=30)
    assert info.value.exit_code == 3
    assert "boom" in info.value.stderr
    assert "boom" in str(info.value)


def test_unchecked_failure_returns() -> None:
    done = proc.run([sys.executable, "-c", "raise SystemExit(4)"], timeout=30, check=False)
    assert done.exit_code == 4


def test_timeout_kills_and_raises() -> None:
    with pytest.raises(CommandTimeout) as info:
        proc.run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert info.value.exit_code is None


def test_missing_program_names_it() -> None:
    with pytest.raises(CommandError, match="cannot run /nonexistent/tool") as info:
        proc.run(["/nonexistent/tool"], timeout=5)
    assert "tool" in info.value.hint


def test_stderr_is_bounded() -> None:
    with pytest.raises(CommandError) as info:
        proc.run([sys.executable, "-c", "import sys; sys.stderr.write('x' * 100000); sys.exit(1)"], timeout=30)
    assert len(info.value.stderr) <= proc.STDERR_TAIL + 3
