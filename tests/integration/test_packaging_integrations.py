"""The framework integrations ship in the wheel: installed outside the checkout, mini-swe-agent's runs from it.

The wheel is built as tests/integration/test_packaging.py builds it (from an
sdist of the tracked sources).  It goes into a fresh venv in a temporary
directory with ``pip install --no-deps --no-index``; the dependencies
(grpcio, mini-swe-agent, ...) are this interpreter's, made visible by a
``.pth`` line naming its site-packages.  A path line in a ``.pth`` file is
appended after the venv's own site-packages, and the ``.pth`` files of the
directory it names are not run, so this venv's editable install of the
checkout does not come with it: ``crabd`` is the wheel's, and the checkout's
``agents`` is not importable (both asserted).  Then the offline recipe,
``python -m crabd.integrations.minisweagent_demo``, runs from that venv
against a test crabd.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from crabd.sdk import Client, EmbeddedDaemon
from tests.conftest import REPO, require
from tests.integration.test_packaging import _copy_sources, _env, _run

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu, pytest.mark.root, pytest.mark.slow]
ENV_CLASS = "crabd.integrations.minisweagent.CrabEnvironment"


@dataclass(frozen=True)
class Installed:
    wheel: Path
    python: Path
    venv: Path


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    require(importlib.util.find_spec("build") is not None, "needs the `build` package (dev extra; run `make setup`)")
    require(importlib.util.find_spec("minisweagent") is not None, "needs the minisweagent extra")
    base = tmp_path_factory.mktemp("integrations")
    assert not base.resolve().is_relative_to(REPO)
    src, dist, venv = base / "src", base / "dist", base / "venv"
    _copy_sources(src)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)], cwd=base)
    (wheel,) = dist.glob("crabd-*.whl")
    _run([sys.executable, "-m", "venv", str(venv)], cwd=base)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--no-index"]
    _run([*pip, str(wheel)], cwd=base)
    purelib = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=base).stdout.strip()
    )
    (purelib / "zz_crab_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    yield Installed(wheel, python, venv)
    shutil.rmtree(base, ignore_errors=True)


def test_the_wheel_carries_the_integrations_and_its_extras_pull_their_frameworks(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as whl:
        names = set(whl.namelist())
        (meta,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = whl.read(meta).decode()
    for module in ("__init__", "minisweagent", "minisweagent_data", "minisweagent_demo", "harbor", "harbor_dockerfile"):
        assert f"crabd/integrations/{module}.py" in names, module
    requires = [
        line.removeprefix("Requires-Dist: ") for line in metadata.splitlines() if line.startswith("Requires-Dist:")
    ]
    assert any(r.startswith("mini-swe-agent==") and 'extra == "minisweagent"' in r for r in requires), requires
    assert any(r.startswith("harbor==") and 'extra == "harbor"' in r for r in requires), requires


def test_mini_swe_agents_offline_recipe_runs_from_the_installed_wheel(
    installed: Installed, daemon: EmbeddedDaemon, tmp_path: Path
) -> None:
    where = (
        "import importlib.util, json, crabd, crabd.integrations.minisweagent as m\n"
        "print(json.dumps({'crabd': crabd.__file__, 'integration': m.__file__,\n"
        "    'agents': importlib.util.find_spec('agents') is not None}))\n"
    )
    got = json.loads(_run([str(installed.python), "-c", where], cwd=tmp_path).stdout.splitlines()[-1])
    assert Path(got["crabd"]).is_relative_to(installed.venv), got
    assert Path(got["integration"]).is_relative_to(installed.venv), got
    assert got["agents"] is False  # nothing of the checkout leaked in

    traj = tmp_path / "run.traj.json"
    with Client(daemon.socket) as c:
        before = {s.id for s in c.list()}
        argv = [str(installed.python), "-m", "crabd.integrations.minisweagent_demo", "--socket", str(daemon.socket)]
        done = subprocess.run(
            [*argv, "-o", str(traj)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert {s.id for s in c.list()} == before  # the demo's sandbox is gone
    assert "after rollback to step 2, calc.py says: return a - b" in done.stdout, done.stdout
    data = json.loads(traj.read_text())
    assert data["info"]["exit_status"] == "Submitted"
    assert data["info"]["config"]["environment_type"] == ENV_CLASS
    steps = data["info"]["crab"]["steps"]
    assert [s["returncode"] for s in steps] == [0, 0, 0, 0]
    # Each step names the checkpoint holding its end state (policy auto: every one is restorable).
    assert all(s["checkpoint_id"].startswith("ck-") for s in steps), steps
