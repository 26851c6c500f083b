"""Harbor's own job runner with crab as its environment (issue 22): oracle trials over local tasks.

Harbor needs Python >= 3.12: in an older interpreter (or without harbor installed) this module is skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

# harbor imports litellm, which otherwise tries to fetch its model price list from the internet.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Job.run's telemetry event (an import of litellm in a thread the process waits for at exit; docs/harbor.md).
os.environ.setdefault("HARBOR_TELEMETRY", "0")

from harbor.environments.base import ExecResult
from harbor.job import Job
from harbor.models.job.config import JobConfig
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig

from crabd.integrations.harbor import IMPORT_PATH, CrabEnvironment
from crabd.sdk import Client, EmbeddedDaemon
from tests.conftest import REPO
from tests.integration.conftest import kill_container

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu, pytest.mark.slow]
TASKS = Path(__file__).resolve().parents[1] / "data" / "harbor"


class KillingCrabEnvironment(CrabEnvironment):
    """Kills its sandbox's container 1 s into the oracle's solve.sh (which takes 3 s), once per trial."""

    killed: ClassVar[list[str]] = []
    recovered: ClassVar[list[int]] = []

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        killer = None
        if "solve.sh" in command and "chmod" not in command and self.sandbox.name not in self.killed:
            self.killed.append(self.sandbox.name)
            killer = asyncio.create_task(self._kill_soon(self.sandbox.info.container_id))
        try:
            return await super().exec(command, cwd, env, timeout_sec, user)
        finally:
            if killer is not None:
                await killer
                self.recovered.append(self.recoveries)

    async def _kill_soon(self, container_id: str) -> None:
        await asyncio.sleep(1.0)
        await asyncio.to_thread(kill_container, container_id)


def run_job(daemon: EmbeddedDaemon, tmp_path: Path, tasks: list[str], **env: Any) -> dict[str, dict[str, Any]]:
    """Harbor's job runner, oracle agent, crab environment: each task's result.json, by task name."""
    env_kwargs = {"socket": str(daemon.socket), "chunk_bytes": 64 * 1024, **env.pop("kwargs", {})}
    config = JobConfig(
        job_name="crab",
        jobs_dir=tmp_path / "jobs",
        n_concurrent_trials=2,
        tasks=[TaskConfig(path=TASKS / t) for t in tasks],
        agents=[AgentConfig(name="oracle")],
        environment=EnvironmentConfig(import_path=env.pop("import_path", IMPORT_PATH), kwargs=env_kwargs),
    )

    async def go() -> None:
        job = await Job.create(config)
        await job.run()

    with Client(daemon.socket) as client:
        before = {s.id for s in client.list()}
        asyncio.run(go())
        left = [s.name for s in client.list() if s.id not in before]
    assert not left, f"sandboxes left behind: {left}"
    results = [json.loads(p.read_text()) for p in (tmp_path / "jobs" / "crab").glob("*/result.json")]
    return {r["task_name"]: r for r in results}


def reward(result: dict[str, Any]) -> float | None:
    verdict = result.get("verifier_result") or {}
    value = (verdict.get("rewards") or {}).get("reward")
    return None if value is None else float(value)


def test_oracle_trials_of_two_local_tasks_pass_their_verifiers_in_crab_sandboxes(
    daemon: EmbeddedDaemon, tmp_path: Path
) -> None:
    results = run_job(daemon, tmp_path, ["hello-file", "binary-copy"])
    assert sorted(results) == ["binary-copy", "hello-file"]
    for name, result in results.items():
        assert result.get("exception_info") is None, (name, result["exception_info"])
        assert reward(result) == 1.0, (name, result.get("verifier_result"))
    # The verifier's copy of the binary came back through download_dir byte for byte.
    (trial,) = (tmp_path / "jobs" / "crab").glob("binary-copy__*")
    assert (trial / "verifier" / "blob.bin").read_bytes() == (TASKS / "binary-copy/solution/blob.bin").read_bytes()


def test_a_sandbox_killed_mid_trial_is_recovered_and_its_trial_still_passes(
    daemon: EmbeddedDaemon, tmp_path: Path
) -> None:
    KillingCrabEnvironment.killed.clear()
    KillingCrabEnvironment.recovered.clear()
    results = run_job(daemon, tmp_path, ["hello-file"], import_path=f"{__name__}:{KillingCrabEnvironment.__name__}")
    assert len(KillingCrabEnvironment.killed) == 1
    assert KillingCrabEnvironment.recovered == [1], "the kill was not seen and recovered"
    result = results["hello-file"]
    assert result.get("exception_info") is None, result["exception_info"]
    assert reward(result) == 1.0, result.get("verifier_result")


def test_an_unreachable_crabd_fails_the_trial_with_crabs_message(daemon: EmbeddedDaemon, tmp_path: Path) -> None:
    missing = tmp_path / "no-crabd.sock"
    results = run_job(daemon, tmp_path, ["hello-file"], kwargs={"socket": str(missing)})
    info = results["hello-file"]["exception_info"]
    assert info is not None
    assert info["exception_type"] == "CrabdUnavailableError"
    assert "crabd is unreachable" in info["exception_message"]
    assert str(missing) in info["exception_message"]  # crab's own message names the socket
    assert reward(results["hello-file"]) is None  # no verifier ran


def test_the_documented_oracle_recipe_runs_as_written_and_exits_promptly(
    daemon: EmbeddedDaemon, tmp_path: Path
) -> None:
    """docs/harbor.md's shell block, against a test crabd; its trial's files go to a temporary -o dir."""
    blocks = re.findall(r"```sh\n(.*?)```", (REPO / "docs" / "harbor.md").read_text(), re.S)
    (block,) = [b for b in blocks if "harbor run" in b]
    script = block.replace("/run/crab/crabd.sock", str(daemon.socket)).rstrip() + f" -o {tmp_path}\n"
    env = {k: v for k, v in os.environ.items() if k not in ("LITELLM_LOCAL_MODEL_COST_MAP", "HARBOR_TELEMETRY")}
    # harbor from this venv (a checkout's .venv-harbor, named first by the block, may be elsewhere).
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", PYTHONPATH=str(REPO))
    start = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-euc", script], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    lines, last = [], start
    for line in proc.stdout:
        lines.append(line)
        last = time.monotonic()
    rc = proc.wait(timeout=300)
    exited = time.monotonic()
    assert rc == 0, "".join(lines)[-3000:]
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("*/hello-file__*/result.json")]
    assert result.get("exception_info") is None and reward(result) == 1.0, result
    # With harbor's telemetry on, the process waited 4.5-12 s here (42 s on a fresh machine) after its
    # last line for a thread that imports litellm to build the job-finished event.
    assert exited - last < 2.0, f"harbor run exited {exited - last:.1f} s after its last line of output"


def test_a_task_image_crab_did_not_build_is_built_by_docker_and_used_as_it_is(
    daemon: EmbeddedDaemon, tmp_path: Path
) -> None:
    """A Dockerfile FROM an image that is not a crab env: Docker builds it, the sandbox starts from that image."""
    base = "crab-harbor-test/base:1"
    bookworm = subprocess.run(
        ["docker", "images", "-q", "--filter", "reference=crab-env/bookworm"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[0]
    subprocess.run(["docker", "tag", bookworm, base], check=True, capture_output=True)
    pins_before = _crab_pins()
    try:
        results = run_job(daemon, tmp_path, ["image-built"])
        result = results["image-built"]
        assert result.get("exception_info") is None, result["exception_info"]
        assert reward(result) == 1.0, result.get("verifier_result")
    finally:
        built = subprocess.run(
            ["docker", "images", "-q", "--filter", "reference=crab-harbor/*"], capture_output=True, text=True
        ).stdout.split()
        # The trial drops its crab-harbor tag at stop(delete=True); crabd's pin of the image stays
        # until its grace is over: the test removes it now.
        subprocess.run(["docker", "rmi", "-f", base, *built, *(_crab_pins() - pins_before)], capture_output=True)


def _crab_pins() -> set[str]:
    """crabd's pins of images (``crab-loaded:<hex>``) in the host's Docker."""
    return set(
        subprocess.run(
            ["docker", "images", "--format", "{{.Repository}}:{{.Tag}}", "crab-loaded"], capture_output=True, text=True
        ).stdout.split()
    )
