"""The docs-block extractor (tests/docblocks.py), and the decision every README/docs block must carry."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.docblocks import (
    Action,
    Decision,
    MarkerError,
    all_blocks,
    blocks,
    missing_claims,
    parse_marker,
    python_claims,
    shell_commands,
    shell_comment,
    shell_script,
    split_output,
)

DOC = Path("doc.md")

SAMPLE = """# Title

<!-- doctest: run -->
```python
print("a # b")  # "a # b"
```

Text.

<!-- doctest: parse-only (needs a vLLM server) -->

```sh
vllm serve x
```

```toml
[proxy]
```

- a list item:

  <!-- doctest: skip (output sample) -->
  ```bash
  $ crabctl ps
  ```

```py
x = 1
```
"""


def test_finds_python_and_shell_blocks_with_their_line_language_code_and_decision() -> None:
    found = blocks(DOC, SAMPLE)
    assert [(b.line, b.lang) for b in found] == [(4, "python"), (12, "sh"), (23, "sh"), (27, "python")]
    assert found[0].code == 'print("a # b")  # "a # b"\n'
    assert found[0].decision == Decision(Action.RUN)
    # A blank line between marker and fence is allowed; the reason is kept.
    assert found[1].decision == Decision(Action.PARSE_ONLY, "needs a vLLM server")
    # An indented block (in a list) loses its indentation.
    assert found[2].code == "$ crabctl ps\n" and found[2].decision == Decision(Action.SKIP, "output sample")
    assert found[3].decision is None
    assert found[0].where == "doc.md:4"


def test_a_fence_inside_another_fence_is_code_not_a_block() -> None:
    text = "````text\n```python\nprint(1)\n```\n````\n\n```python\nprint(2)\n```\n"
    [only] = blocks(DOC, text)
    assert only.code == "print(2)\n" and only.line == 7


@pytest.mark.parametrize(
    ("marker", "decision"),
    [
        ("<!-- doctest: run -->", Decision(Action.RUN)),
        ("  <!--doctest: run (fast) -->", Decision(Action.RUN, "fast")),
        ("<!-- doctest: parse-only (needs a GPU (an H100)) -->", Decision(Action.PARSE_ONLY, "needs a GPU (an H100)")),
        ("<!-- doctest: skip (output) -->", Decision(Action.SKIP, "output")),
        ("<!-- an ordinary comment -->", None),
        ("Some text.", None),
    ],
)
def test_markers(marker: str, decision: Decision | None) -> None:
    assert parse_marker(marker) == decision


@pytest.mark.parametrize(
    "marker",
    ["<!-- doctest: skip -->", "<!-- doctest: parse-only -->", "<!-- doctest: runs -->", "<!-- doctest run -->"],
)
def test_bad_markers_are_errors_not_silently_no_decision(marker: str) -> None:
    with pytest.raises(MarkerError):
        parse_marker(marker)
    with pytest.raises(MarkerError, match=r"doc\.md:1"):
        blocks(DOC, f"{marker}\n```sh\ntrue\n```\n")


def test_python_claims_come_from_comments_only() -> None:
    code = 'print("# \\"not\\"")  # "one", "two" then prose\nx = 1  # prose "not a claim"\n# "three"\n'
    assert python_claims(code) == ["one", "two", "three"]


def test_shell_comments_skip_quotes_and_words_with_hashes() -> None:
    assert shell_comment("echo '# no' \"# no\" a#b  # yes") == "# yes"
    assert shell_comment("echo \\# no") == ""
    assert shell_comment("echo $X") == ""


def test_shell_commands_join_continuations_and_drop_comment_lines() -> None:
    code = '# setup\ncrabctl ps   # "id"\n\nfoo \\\n  --bar   # "b..."\nrm x\n'
    cmds = shell_commands(code)
    assert [(c.text, c.line, c.claims) for c in cmds] == [
        ('crabctl ps   # "id"', 2, ["id"]),
        ('foo \\\n  --bar   # "b..."', 4, ["b..."]),
        ("rm x", 6, []),
    ]


def test_claims_match_in_order_and_dots_stand_for_any_text() -> None:
    out = "turn 3: done ck-1234abcd\nPython 3.11.2\n"
    assert missing_claims(["turn 3: done ck-...", "Python 3.11"], out) == []
    assert missing_claims(["Python", "turn 3"], out) == ["turn 3"]  # order counts
    assert missing_claims(["ck-...Python"], out) == ["ck-...Python"]  # ... stays on one line
    assert missing_claims(["a.b"], "axb") == ["a.b"]  # the rest is literal


def test_shell_script_runs_commands_in_one_shell_and_stops_at_the_first_failure() -> None:
    cmds = shell_commands('x=1 # sets x\nprintf "no newline $x"\necho err >&2\nfalse\necho never\n')
    done = subprocess.run(["bash", "-c", shell_script(cmds)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 97
    runs = split_output(done.stdout, len(cmds))
    assert [r.rc for r in runs] == [0, 0, 0, 1]
    assert runs[1].output.startswith("no newline 1") and "err" in runs[2].output


# --- the docs themselves ----------------------------------------------------------------------

DOC_BLOCKS = all_blocks(REPO)


def test_every_python_and_shell_block_in_readme_and_docs_carries_a_decision() -> None:
    undecided = [b.where for b in DOC_BLOCKS if b.decision is None]
    assert not undecided, (
        "these blocks need a <!-- doctest: run | parse-only (why) | skip (why) --> line right above them "
        f"(tests/docblocks.py): {undecided}"
    )
    assert any(b.path.name == "README.md" and b.decision == Decision(Action.RUN) for b in DOC_BLOCKS)


@pytest.mark.parametrize(
    "block",
    [b for b in DOC_BLOCKS if b.decision is not None and b.decision.action is not Action.SKIP],
    ids=lambda b: b.where,
)
def test_every_block_meant_to_run_parses(block: object) -> None:
    from tests.docblocks import Block

    assert isinstance(block, Block)
    if block.lang == "python":
        ast.parse(block.code, filename=block.where)
    else:
        done = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{block.where}: {done.stderr}"


_VENV_PYTHON = re.compile(r"\.venv/bin/python\s+(?:-m\s+(?P<module>[\w.]+)|(?P<script>[\w./-]+\.py))")


def test_every_documented_python_command_names_a_module_that_exists() -> None:
    """``.venv/bin/python -m X`` names an importable module; a script inside a package would not import it."""
    wrong: list[str] = []
    for block in DOC_BLOCKS:
        if block.lang != "sh" or block.decision is None or block.decision.action is Action.SKIP:
            continue
        for m in _VENV_PYTHON.finditer(block.code):
            if m["module"] and importlib.util.find_spec(m["module"]) is None:
                wrong.append(f"{block.where}: no module {m['module']}")
            if m["script"] and (REPO / m["script"]).parent.joinpath("__init__.py").exists():
                wrong.append(f"{block.where}: {m['script']} is in a package: run it with -m")
    assert not wrong
