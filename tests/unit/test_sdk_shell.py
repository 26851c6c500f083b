"""The shell text the SDK's adapters share (crabd/sdk/shell.py), run by a real bash."""

from __future__ import annotations

import subprocess
from pathlib import Path

from crabd.sdk import shell


def _bash(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "--noprofile", "--norc", "-c", text], capture_output=True, text=True, timeout=30)


def test_merged_keeps_state_and_ends_heredocs_and_comments() -> None:
    text = shell.merged("cd /tmp; X=1; echo err >&2 # a comment on the last line") + "\necho $PWD $X"
    r = _bash(text)
    assert r.stdout == "err\n/tmp 1\n" and r.stderr == ""
    heredoc = shell.merged("cat <<EOF\nin\nEOF")
    assert _bash(heredoc).stdout == "in\n"


def test_sourced_quotes_the_path(tmp_path: Path) -> None:
    odd = tmp_path / "it's a $file"
    odd.write_text("Y=2; echo sourced >&2\n")
    r = _bash(shell.sourced(str(odd)) + "\necho $Y")
    assert r.stdout == "sourced\n2\n"


def test_write_file_argv_makes_the_directory(tmp_path: Path) -> None:
    target = tmp_path / "a b" / "c.txt"
    subprocess.run(shell.write_file_argv(str(target)), input=b"data\n", check=True, timeout=30)
    assert target.read_bytes() == b"data\n"
