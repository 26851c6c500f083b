"""crab as a SWE-ReX deployment and runtime, driven through swe-rex 1.4's own interfaces and models."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest
from swerex.deployment.config import get_deployment
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from crabd.integrations.swerex import CrabDeployment, CrabDeploymentConfig, CrabRuntime
from crabd.sdk import Client, EmbeddedDaemon

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu]


def test_swe_agent_style_calls_on_a_crab_sandbox(daemon: EmbeddedDaemon, client: Client, tmp_path: Path) -> None:
    # swe-rex's own factory takes any config with get_deployment() (its union is for type checkers).
    deployment = cast(CrabDeployment, get_deployment(CrabDeploymentConfig(socket=str(daemon.socket))))  # type: ignore[arg-type]
    with pytest.raises(DeploymentNotStartedError):
        _ = deployment.runtime
    # SWE-agent runs every call in an asyncio.run of its own; so does this test.
    asyncio.run(deployment.start())
    rt = deployment.runtime
    assert isinstance(rt, CrabRuntime) and asyncio.run(rt.is_alive()).is_alive

    def act(command: str, **kw: Any) -> BashObservation:
        return asyncio.run(rt.run_in_session(BashAction(command=command, **kw)))

    asyncio.run(rt.create_session(CreateBashSessionRequest(session="default")))
    asyncio.run(rt.create_session(CreateBashSessionRequest(session="tests")))
    with pytest.raises(SessionExistsError):
        asyncio.run(rt.create_session(CreateBashSessionRequest(session="tests")))
    act("cd /tmp && export LANG=C.UTF-8 X=1")
    obs = act("echo $X $PWD; echo err >&2", check="silent")
    assert obs.output == "1 /tmp\nerr\n" and obs.exit_code == 0
    assert act("echo ${X:-unset}", session="tests").output == "unset\n"
    assert act("false", check="silent").exit_code == 1
    assert act("false", check="ignore").exit_code is None
    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        act("(exit 3)")
    with pytest.raises(BashIncorrectSyntaxError):
        act("if then fi")
    with pytest.raises(SessionDoesNotExistError):
        act("true", session="nope")
    with pytest.raises(CommandTimeoutError):
        act("sleep 30", timeout=1)
    interrupted = asyncio.run(rt.run_in_session(BashInterruptAction()))
    assert interrupted.exit_code == 0 and "restarted" in interrupted.failure_reason
    # A fresh bash with the session's state as of the last turn end (each action is a turn).
    assert act("echo ${X:-fresh} $PWD").output == "1 /tmp\n"

    r = asyncio.run(rt.execute(Command(command="echo hi; exit 4", shell=True)))
    assert (r.stdout, r.exit_code) == ("hi\n", 4)
    with pytest.raises(NonZeroExitCodeError):
        asyncio.run(rt.execute(Command(command="which no-such-tool", shell=True, check=True)))
    asyncio.run(rt.write_file(WriteFileRequest(content="data\n", path="/root/sub/f.txt")))
    assert asyncio.run(rt.read_file(ReadFileRequest(path="/root/sub/f.txt"))).content == "data\n"
    with pytest.raises(FileNotFoundError):
        asyncio.run(rt.read_file(ReadFileRequest(path="/root/none")))
    (tmp_path / "tool" / "bin").mkdir(parents=True)
    (tmp_path / "tool" / "bin" / "run").write_text("#!/bin/sh\necho tool\n")
    asyncio.run(rt.upload(UploadRequest(source_path=str(tmp_path / "tool"), target_path="/root/tools/t")))
    assert act("cat /root/tools/t/bin/run", check="silent").output == "#!/bin/sh\necho tool\n"

    # crab on top: checkpoint, a destructive action, rollback; fork into two runtimes.
    ck = asyncio.run(rt.checkpoint("before rm"))
    act("rm -rf /root/sub")
    assert asyncio.run(rt.restore(ck)) == []
    assert act("cat /root/sub/f.txt").output == "data\n"
    forks = asyncio.run(rt.fork(2, ck))
    outs = [asyncio.run(f.run_in_session(BashAction(command="cat /root/sub/f.txt"))).output for f in forks]
    assert outs == ["data\n", "data\n"]
    for f in forks:
        asyncio.run(f.close())
        client.get(f.sandbox_id).remove(force=True)

    asyncio.run(rt.close_session(CloseBashSessionRequest(session="tests")))
    asyncio.run(deployment.stop())
    asyncio.run(deployment.stop())  # idempotent, as SWE-ReX's __del__ calls it again
    assert rt.sandbox_id not in {s.id for s in client.list()}
