"""crabctl's manners (docs/cli.md): usage errors, help, --json, ids, timeouts, messages, startup cost.

Commands run through ``crabd.cli.main.run`` (what the ``crabctl`` entry point runs) against a fake
SDK client; nothing here needs a crabd.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from typer import _click
from typer.main import get_command

from crabd.cli import checkpoints, common, sandboxes
from crabd.cli.common import app
from crabd.cli.core import CrabGroup
from crabd.cli.main import run
from crabd.errors import CrabError, InvalidRequest, SandboxNotFound
from crabd.sdk.models import CheckpointDetail, CheckpointInfo, ExecResult, GcResult, OutputChunk, SandboxInfo

ME = os.getuid()


def info(sid: str, name: str, **kw: Any) -> SandboxInfo:
    base = SandboxInfo(
        id=sid,
        name=name,
        owner_uid=ME,
        env="bookworm",
        image="crab/bookworm",
        container_id="c-" + sid,
        state="running",
        created_at=1_700_000_000.0,
        cpus=0.0,
        memory_bytes=0,
        pids=0,
        network=False,
        env_vars={},
        workdir="/",
        ip_address="",
        exit_code=0,
        oom_killed=False,
        dead_reason="",
        turn=1,
        turn_open=False,
    )
    return replace(base, **kw)


def ck(cid: str, sandbox_id: str, **kw: Any) -> CheckpointInfo:
    from crabd.models import CheckpointKind

    base = CheckpointInfo(
        id=cid,
        sandbox_id=sandbox_id,
        sandbox_name="web",
        owner_uid=ME,
        parent_id="",
        branch=0,
        turn=1,
        kind=CheckpointKind.FS,
        created_at=1_700_000_100.0,
        label="",
        has_session_state=True,
        image="img",
        kept=True,
        entries=3,
        changed=1,
        deleted=0,
        logical_bytes=10,
        bytes_read=10,
        new_bytes=10,
        freeze_s=0.001,
        prescan_s=0.0,
        total_s=0.01,
        image_bytes=0,
    )
    return replace(base, **kw)


@dataclass
class FakeSandbox:
    client: FakeClient
    info: SandboxInfo
    result: ExecResult = field(default_factory=lambda: ExecResult(0, b"", b""))

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def session(self) -> FakeSandbox:
        return self

    def __call__(self, name: str) -> FakeSandbox:  # sb.session("name"): a named session
        self.client.calls.append(("session", name, {}))
        return self

    def stream(self, command: Any, **kw: Any) -> Iterator[OutputChunk | ExecResult]:
        self.client.calls.append(("stream", command, kw))
        yield self.result

    def remove(self, force: bool = True, *, keep_checkpoints: bool = False) -> None:
        self.client.calls.append(("remove", self.id, force))
        self.client.sandboxes = [s for s in self.client.sandboxes if s.id != self.id]

    def turns(self, limit: int = 0) -> list[Any]:
        return []


@dataclass
class FakeClient:
    sandboxes: builtins.list[SandboxInfo] = field(default_factory=list)
    cks: builtins.list[CheckpointInfo] = field(default_factory=list)
    calls: builtins.list[tuple[Any, ...]] = field(default_factory=list)
    result: ExecResult = field(default_factory=lambda: ExecResult(0, b"", b""))
    fail: CrabError | None = None

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def list(self) -> list[FakeSandbox]:
        return [FakeSandbox(self, i) for i in self.sandboxes]

    def get(self, ref: str) -> FakeSandbox:
        if self.fail is not None:
            raise self.fail
        for i in self.sandboxes:
            if ref in (i.id, i.name):
                return FakeSandbox(self, i, self.result)
        raise SandboxNotFound(f"no sandbox {ref!r}", sandbox=ref)

    def checkpoints(self, sandbox: str = "", *, include_remote: bool = False) -> builtins.list[CheckpointInfo]:
        return self.cks

    def checkpoint(self, ref: str) -> CheckpointDetail:
        return CheckpointDetail(self.cks[0], [], False, {"cwd": "/", "env": {"A": "1"}}, [self.cks[0].id])

    def fork(self, ref: str, n: int, *, name_prefix: str = "") -> builtins.list[FakeSandbox]:
        self.calls.append(("fork", ref, n, name_prefix))
        return [FakeSandbox(self, info(f"f{i:011x}", f"{name_prefix}-{i}", origin=ref)) for i in range(n)]

    def gc(self) -> GcResult:
        return GcResult(1, 100, 0, 1, 2048, 0.1)

    def create_from(self, options: Any) -> FakeSandbox:
        self.calls.append(("create", options))
        return FakeSandbox(self, info("0123456789ab", options.name or "sb-012345"))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    c = FakeClient()
    for module in (sandboxes, checkpoints):
        monkeypatch.setattr(module, "client", lambda: c)
    monkeypatch.setattr(common.state, "debug", False)
    return c


def crabctl(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = run(list(args))
    got = capsys.readouterr()
    return code, got.out, got.err


# --- usage errors, help, version ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["create"], "give an ENV or --image IMAGE"),
        (["exec", "sb"], "Missing argument 'CMD'"),
        (["status"], "No such command 'status'"),
        (["fork", "-n", "abc", "x"], "'abc' is not a valid integer"),
        (["ps", "--nope"], "No such option: --nope"),
        (["create", "bookworm", "-e", "FOO"], "the env image is positional"),
        (["sh", "sb", "true", "--turn"], "No such option: --turn"),
        (["restore", "sb"], "name a checkpoint CK or give --turn N"),
    ],
)
def test_a_usage_error_exits_2_with_clicks_message(
    fake: FakeClient, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _, err = crabctl(capsys, *args)
    assert code == 2 and message in err and "internal error" not in err
    code, out, err = crabctl(capsys, *args, "--json")
    assert code == 2 and out == ""
    error = json.loads(err)["error"]
    assert error["type"] == "UsageError" and message in error["message"] and "--help" in error["hint"]
    assert fake.calls == []


def _commands() -> Iterator[tuple[list[str], _click.Command]]:
    def walk(group: CrabGroup, path: list[str]) -> Iterator[tuple[list[str], _click.Command]]:
        for name in group.list_commands(_click.Context(group)):
            cmd = group.get_command(_click.Context(group), name)
            assert cmd is not None
            yield [*path, name], cmd
            if isinstance(cmd, CrabGroup):
                yield from walk(cmd, [*path, name])

    root = get_command(app)
    assert isinstance(root, CrabGroup)
    return walk(root, [])


COMMANDS = list(_commands())


def test_h_and_help_work_everywhere_and_name_values_readably(capsys: pytest.CaptureFixture[str]) -> None:
    assert len(COMMANDS) > 40
    for path, _ in [([], None), *COMMANDS]:
        for flag in ("-h", "--help"):
            code, out, err = crabctl(capsys, *path, flag)
            assert code == 0 and err == "", (path, err)
            assert out.startswith(f"Usage: {' '.join(['crabctl', *path])} "), out
            # No typer-isms in usage lines or option lists.
            assert not re.search(r"<(bool|str|int|float|list\[str\])>|\{\w+\}", out), (path, out)


def test_every_command_takes_json() -> None:
    leaves = [path for path, cmd in COMMANDS if not isinstance(cmd, CrabGroup)]
    missing = [path for path, cmd in COMMANDS if path in leaves and not any("--json" in p.opts for p in cmd.params)]
    assert not missing


def test_version_and_grouped_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = crabctl(capsys, "--version")
    assert code == 0 and re.fullmatch(r"crabctl \d+\.\d+\.\d+\n", out)
    _, out, _ = crabctl(capsys, "--help")
    panels = [line[:-1] for line in out.splitlines() if re.fullmatch(r"[A-Z]\w+:", line)]
    assert panels == ["Options", "Sandboxes", "Turns", "Checkpoints", "Store", "Host"]
    sandboxes_panel = out.split("Sandboxes:")[1].split("Turns:")[0]
    assert [line.split()[0] for line in sandboxes_panel.strip().splitlines()][:3] == ["create", "ps", "inspect"]


# --- errors -----------------------------------------------------------------------------------


def test_a_crab_error_keeps_its_brackets_and_is_json_under_json(
    fake: FakeClient, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.fail = InvalidRequest(
        "no remote tier ([remote] enabled = false)", hint="Configure [remote] in crabd.toml; see docs/remote.md."
    )
    code, out, err = crabctl(capsys, "inspect", "web")
    assert code == 1 and out == ""
    assert "error: no remote tier ([remote] enabled = false)" in err
    assert "hint: Configure [remote] in crabd.toml" in err
    code, out, err = crabctl(capsys, "inspect", "web", "--json")
    assert code == 1 and out == ""
    assert json.loads(err) == {
        "error": {
            "type": "InvalidRequest",
            "message": "no remote tier ([remote] enabled = false)",
            "hint": "Configure [remote] in crabd.toml; see docs/remote.md.",
        }
    }


# --- flags ------------------------------------------------------------------------------------


def test_create_takes_the_image_positionally_and_e_as_environment(
    fake: FakeClient, capsys: pytest.CaptureFixture[str]
) -> None:
    from crabd.sdk import CreateOptions

    code, out, _ = crabctl(capsys, "create", "bookworm", "-e", "A=1", "--env", "B=x=y", "--name", "web")
    assert code == 0 and out == "0123456789ab web\n"
    options = fake.calls[-1][1]
    assert options == CreateOptions("bookworm", name="web", env_vars={"A": "1", "B": "x=y"})
    crabctl(capsys, "create", "bookworm")
    assert fake.calls[-1][1] == CreateOptions("bookworm", env_vars={})  # the SDK's defaults


@pytest.mark.parametrize(
    "args",
    [
        ["exec", "web", "--timeout", "2", "--", "sleep", "10"],
        ["exec", "web", "--timeout", "2", "sleep", "10"],
        ["exec", "--timeout=2", "web", "sleep", "10"],
    ],
)
def test_exec_options_end_where_the_command_begins(
    fake: FakeClient, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    fake.sandboxes = [info("0123456789ab", "web")]
    code, _, _ = crabctl(capsys, *args)
    assert code == 0
    expected = {"timeout": 2.0, "workdir": "", "user": "", "env": {}, "turn": ""}
    assert fake.calls == [("stream", ["sleep", "10"], expected)]


def test_exec_passes_the_commands_own_options(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    fake.sandboxes = [info("0123456789ab", "web")]
    crabctl(capsys, "exec", "web", "ls", "-l", "--json")
    crabctl(capsys, "exec", "web", "-e", "A=1", "--", "env", "--timeout")
    assert [c[1] for c in fake.calls] == [["ls", "-l", "--json"], ["env", "--timeout"]]
    assert fake.calls[1][2]["env"] == {"A": "1"}


@pytest.mark.parametrize("command", ["exec", "sh"])
def test_a_timed_out_command_exits_124_from_exec_and_sh(
    fake: FakeClient, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    def args(*options: str) -> list[str]:
        if command == "exec":
            return ["exec", "web", *options, "--", "sleep", "9"]
        return ["sh", "web", *options, "sleep 9"]

    fake.sandboxes = [info("0123456789ab", "web")]
    # exec's killed command reports 137 (SIGKILL), sh's 124: crabctl says 124 for both.
    fake.result = ExecResult(137 if command == "exec" else 124, b"", b"", timed_out=True, duration_s=1.0)
    code, _, err = crabctl(capsys, *args("--timeout", "1"))
    assert code == 124 and "timed out" in err
    code, out, _ = crabctl(capsys, *args("--json"))
    assert code == 124 and json.loads(out)["exit_code"] == 124


def test_rm_with_forks_removes_the_callers_forks_recursively(
    fake: FakeClient, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.sandboxes = [
        info("aaaa00000001", "web"),
        info("bbbb00000001", "web-1", origin="ck-aaaa00000001"),
        info("cccc00000001", "web-1-1", origin="ck-bbbb00000001"),
        info("dddd00000001", "other", origin="ck-eeee00000001"),
        info("ffff00000001", "theirs", origin="ck-aaaa00000001", owner_uid=ME + 1),
    ]
    fake.cks = [ck("ck-aaaa00000001", "aaaa00000001"), ck("ck-bbbb00000001", "bbbb00000001")]
    code, out, _ = crabctl(capsys, "rm", "--force", "--with-forks", "web", "--json")
    assert code == 0
    assert json.loads(out)["removed"] == ["cccc00000001", "bbbb00000001", "aaaa00000001"]
    assert [s.name for s in fake.sandboxes] == ["other", "theirs"]
    assert all(c[2] is True for c in fake.calls if c[0] == "remove")


def test_fork_names_them_by_name_prefix_and_counts_agree(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = crabctl(capsys, "fork", "ck-0123456789ab", "--name-prefix", "br")
    assert code == 0 and fake.calls == [("fork", "ck-0123456789ab", 1, "br")]
    assert out.split()[1] == "br-0" and "1 sandbox from ck-0123456789ab" in err
    _, _, err = crabctl(capsys, "fork", "ck-0123456789ab", "-n", "2")
    assert "2 sandboxes from" in err


# --- what tables and reports print ---------------------------------------------------------------


def test_ps_prints_short_unique_ids_whole_at_80_columns(
    fake: FakeClient, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    fake.sandboxes = [info(f"149aca12{i:04x}", f"sb-149aca-{i}", ip_address=f"10.88.0.{i}") for i in range(5)]
    _, out, _ = crabctl(capsys, "ps")
    assert "…" not in out
    for i in range(5):
        assert f"149aca12000{i}" in out and f"sb-149aca-{i}" in out  # 12 digits: 8 would not be unique
    fake.sandboxes = [info("149aca120000", "a"), info("27aa00000000", "b")]
    _, out, _ = crabctl(capsys, "ps")
    assert "149aca12 " in out and "149aca120000" not in out
    _, out, _ = crabctl(capsys, "ps", "--no-trunc")
    assert "149aca120000" in out


def test_ps_quiet_prints_only_ids_that_rm_takes(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    fake.sandboxes = [info("149aca120000", "a"), info("27aa00000000", "b")]
    code, out, _ = crabctl(capsys, "ps", "-q")
    assert code == 0 and out.splitlines() == ["149aca12", "27aa0000"]
    _, out, _ = crabctl(capsys, "ps", "--quiet", "--no-trunc")
    assert out.splitlines() == ["149aca120000", "27aa00000000"]
    code, _, _ = crabctl(capsys, "rm", "--force", *out.split())
    assert code == 0 and fake.sandboxes == []
    _, out, _ = crabctl(capsys, "ps", "-q")
    assert out == ""


def test_inspect_prints_times_as_times_and_kept_for_as_pin_does(
    fake: FakeClient, capsys: pytest.CaptureFixture[str]
) -> None:
    from crabd.models import KeepReason

    fake.sandboxes = [info("0123456789ab", "web")]
    _, out, _ = crabctl(capsys, "inspect", "web")
    assert "1700000000" not in out and re.search(r"created_at\s+│?\s*2023-11-1\d \d\d:\d\d:\d\d", out)
    fake.cks = [ck("ck-0123456789ab", "0123456789ab", kept_for=(KeepReason.PINNED,))]
    _, out, _ = crabctl(capsys, "checkpoint", "inspect", "ck-0123")
    assert re.search(r"kept for\s+│?\s*pinned", out) and "None" not in out and "1700000100" not in out
    assert "1 exported variable\n" in out or "1 exported variable " in out


def test_gc_says_its_sizes_are_on_disk(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = crabctl(capsys, "gc")
    assert out.startswith("removed 1 blob (100 B on disk); 1 live blob (2.0 KiB on disk, compressed)")


# --- startup cost ---------------------------------------------------------------------------------


def _imported(*args: str, preamble: str = "") -> set[str]:
    """The modules a crabctl run with ``args`` loaded (in a fresh interpreter; no crabd to reach)."""
    code = (
        f"import json, sys\n{preamble}"
        "from crabd.cli.main import run\n"
        "run(sys.argv[1:])\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    env = {**os.environ, "CRAB_SOCKET": "/nonexistent/crabd.sock"}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=60)
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


def test_help_and_usage_errors_load_no_rich_sdk_or_pydantic() -> None:
    for args in (["--help"], ["checkpoint", "--help"], ["create"]):
        loaded = _imported(*args)
        heavy = {m for m in loaded if m.split(".")[0] in ("rich", "pydantic", "grpc", "docker", "ray", "cryptography")}
        heavy |= {m for m in loaded if m.startswith(("crabd.sdk", "crabd.config", "crabd.host", "typer.rich_utils"))}
        assert not heavy, (args, sorted(heavy)[:10])


def test_a_command_converts_its_values_without_pydantic() -> None:
    assert "typer._adapters" not in _imported("ps")


def test_ps_prints_its_table_without_rich() -> None:
    fake_client = (
        "import contextlib, crabd.cli.sandboxes as sandboxes\n"
        "class C:\n"
        "    def list(self): return []\n"
        "sandboxes.client = lambda: contextlib.nullcontext(C())\n"
    )
    loaded = _imported("ps", preamble=fake_client)
    assert "crabd.cli.sandboxes" in loaded and not {m for m in loaded if m.split(".")[0] == "rich"}


def test_a_commands_own_json_flag_is_not_crabctls(fake: FakeClient, capsys: pytest.CaptureFixture[str]) -> None:
    # `exec SB ls --json`: --json is the command's; an error prints for people.
    code, _, err = crabctl(capsys, "exec", "nowhere", "ls", "--json")
    assert code == 1 and err.startswith("error: no sandbox 'nowhere'")
    code, _, err = crabctl(capsys, "exec", "nowhere", "--json", "ls")
    assert code == 1 and json.loads(err)["error"]["type"] == "SandboxNotFound"
