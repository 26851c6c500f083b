from __future__ import annotations

import subprocess
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


def test_a_helper_without_pipes_is_reaped_when_it_exits_not_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    # Popen.wait(timeout) polls with sleeps of up to 50 ms (it made every `runc create` up to 50 ms late).
    waits: list[float | None] = []
    real = subprocess.Popen.wait

    def wait(self: subprocess.Popen[bytes], timeout: float | None = None) -> int:
        waits.append(timeout)
        return int(real(self, timeout))

    monkeypatch.setattr(subprocess.Popen, "wait", wait)
    done = proc.run(["sh", "-c", "sleep 0.2; exit 5"], timeout=10, capture=False, check=False)
    assert done.exit_code == 5 and done.stdout == b"" and waits == [None]


def test_a_helper_without_pipes_still_times_out() -> None:
    with pytest.raises(CommandTimeout):
        proc.run(["sleep", "30"], timeout=0.3, capture=False)
    with pytest.raises(CommandError) as info:
        proc.run(["sh", "-c", "exit 7"], timeout=10, capture=False)
    assert info.value.exit_code == 7
