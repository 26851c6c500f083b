"""The package is complete: a wheel and an sdist, installed into fresh virtualenvs, work without the checkout.

The sources are copied out of the checkout first (what git tracks, plus new
files it does not ignore: no generated code, no built crab-init, no .venv),
and ``python -m build`` makes the sdist from that copy and the wheel from the
unpacked sdist, as PyPA's build does by default; so a file missing from the
sdist is missing from the wheel too.  Each artifact goes into its own fresh
venv (``pip install`` with its dependencies from the package index: the
sdist through pip's own isolated build), and every check runs from a
directory outside the checkout, with nothing of the checkout on ``sys.path``.

Needs root for ``crabctl host setup --dry-run`` (it runs the set-up script's
checks); it changes nothing on the host.  crab-init is compiled into a
temporary ``$CRAB_LIB_DIR``, not /opt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from crabd.util import resources
from tests.conftest import REPO, require

pytestmark = [pytest.mark.hostless, pytest.mark.root, pytest.mark.slow]

#: Each shipped file as the repository has it (directories expanded), relative to the root.
SHIPPED_FILES = sorted(
    str(p.relative_to(REPO))
    for rel in resources.SHIPPED
    for p in ([REPO / rel] if (REPO / rel).is_file() else (REPO / rel).rglob("*"))
    if p.is_file() and "__pycache__" not in p.parts
)
INIT_SOURCE = "crabd/runtime/init/crab-init.c"


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path
    venvs: dict[str, Path]  # "wheel" / "sdist" -> the venv it was installed into


def _env() -> dict[str, str]:
    """The caller's environment less anything that would point Python or crab at the checkout."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "CRAB_CONFIG", "CRAB_SOCKET", "CRAB_DRY_RUN")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(argv: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        argv, cwd=cwd, env={**_env(), **env}, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def _copy_sources(dest: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        src = REPO / os.fsdecode(name)
        if not src.is_file():  # deleted in the work tree but still in the index
            continue
        target = dest / os.fsdecode(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    require(importlib.util.find_spec("build") is not None, "needs the `build` package (dev extra; run `make setup`)")
    require(shutil.which("git") is not None, "needs git")
    base = tmp_path_factory.mktemp("packaging")
    src, dist = base / "src", base / "dist"
    _copy_sources(src)
    # --no-isolation: the build requirements (setuptools, grpcio-tools) are this venv's, pinned alike.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)], cwd=base)
    (sdist,) = dist.glob("crabd-*.tar.gz")
    (wheel,) = dist.glob("crabd-*.whl")
    # Two fresh venvs, installed at once (pip spends its time on downloads and unpacking).
    venvs = {"wheel": base / "venv-wheel", "sdist": base / "venv-sdist"}
    installs = {}
    for kind, artifact in (("wheel", wheel), ("sdist", sdist)):
        venv = venvs[kind]
        _run([sys.executable, "-m", "venv", str(venv)], cwd=base)
        argv = [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            str(artifact),
        ]
        installs[kind] = subprocess.Popen(
            argv, cwd=base, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    for kind, p in installs.items():
        output, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"pip install of the {kind} failed:\n{output}"
    yield Built(sdist, wheel, venvs)
    shutil.rmtree(base, ignore_errors=True)


def test_sdist_carries_every_shipped_file(built: Built) -> None:
    with tarfile.open(built.sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n.removeprefix(top + "/") for n in tar.getnames()}
    missing = [f for f in [*SHIPPED_FILES, INIT_SOURCE, "setup.py", "MANIFEST.in"] if f not in names]
    assert missing == []
    assert "crabd/runtime/init/crab-init" not in names


def test_wheel_is_pure_and_carries_the_data_files(built: Built) -> None:
    assert built.wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(built.wheel) as whl:
        names = set(whl.namelist())
    missing = [f for f in SHIPPED_FILES if f"crabd/_data/{f}" not in names]
    assert missing == [] and INIT_SOURCE in names
    assert "crabd/runtime/init/crab-init" not in names  # never a (static, arch-specific) binary
    assert "crabd/api/v1/crab_pb2.py" in names


KINDS = ["wheel", "sdist"]


@pytest.mark.parametrize("kind", KINDS)
def test_resources_resolve_inside_the_installed_package(built: Built, kind: str, tmp_path: Path) -> None:
    venv = built.venvs[kind]
    script = (
        "import json, sys, crabd\n"
        "from crabd.util import resources as r\n"
        "from crabd.inspector import bpf\n"
        "from crabd.host import images\n"
        "paths = {rel: str(r.path(rel)) for rel in r.SHIPPED}\n"
        "paths.update(init=str(r.crab_init_source()), bpf=str(bpf.PROGRAM), recipes=str(images.DEFAULT_RECIPES_DIR))\n"
        "print(json.dumps({'package': crabd.__file__, 'installed': r.installed(), 'sys_path': sys.path,\n"
        "    'paths': paths, 'envs': [x.name for x in images.list_recipes()]}))\n"
    )
    got = json.loads(_run([str(venv / "bin" / "python"), "-c", script], cwd=tmp_path).stdout)
    package = Path(got["package"]).parent
    assert package.is_relative_to(venv) and got["installed"]
    assert not any(p and Path(p).resolve().is_relative_to(REPO) for p in got["sys_path"])
    for name, path in got["paths"].items():
        assert Path(path).is_relative_to(package), (name, path)
        assert Path(path).exists(), (name, path)
    assert got["paths"]["bpf"] == str(package / "_data" / "ebpf" / "inspector.c")
    assert sorted(got["envs"]) == sorted(p.name for p in (REPO / "envs" / "images").iterdir())


@pytest.mark.parametrize("kind", KINDS)
def test_crabctl_runs_from_the_installed_package(built: Built, kind: str, tmp_path: Path) -> None:
    bin_ = built.venvs[kind] / "bin"
    assert "host" in _run([str(bin_ / "crabctl"), "--help"], cwd=tmp_path).stdout
    _run([str(bin_ / "crabd"), "--help"], cwd=tmp_path)


def test_host_setup_dry_run_changes_nothing(built: Built, tmp_path: Path) -> None:
    venv = built.venvs["wheel"]
    lib = tmp_path / "lib"
    done = _run(
        [str(venv / "bin" / "crabctl"), "host", "setup", "--dry-run", "--json"], cwd=tmp_path, CRAB_LIB_DIR=str(lib)
    )
    report = json.loads(done.stdout)
    assert report["dry_run"] is True
    steps = {s["step"]: s for s in report["steps"]}
    assert list(steps) == ["host", "crab-init", "images", "criu-kdat"]
    script = Path(steps["host"]["detail"])
    assert script.is_relative_to(venv) and script.name == "setup-host.sh"
    assert "[setup-host]" in done.stderr and "dry run: nothing was changed" in done.stderr
    # This venv's crab-init was never compiled: the plan says where it would go, and nothing is made.
    assert steps["crab-init"]["changes"] == [f"compile crab-init into {lib}/{_init_name(venv)}"]
    assert not lib.exists()
    human = _run([str(venv / "bin" / "crabctl"), "host", "setup", "--dry-run"], cwd=tmp_path, CRAB_LIB_DIR=str(lib))
    assert "would change:" in human.stdout or "nothing to change" in human.stdout


def _init_name(venv: Path) -> str:
    script = "from crabd.util import resources; print(resources.crab_init_binary().name)"
    return _run([str(venv / "bin" / "python"), "-c", script], cwd=venv).stdout.strip()


def test_crab_init_compiles_from_the_shipped_source(built: Built, tmp_path: Path) -> None:
    require(shutil.which("gcc") is not None, "needs gcc (make setup installs it)")
    venv, lib = built.venvs["wheel"], tmp_path / "lib"
    script = "from crabd.runtime import initbin; print(initbin.build()); print(initbin.is_built())"
    out = _run([str(venv / "bin" / "python"), "-c", script], cwd=tmp_path, CRAB_LIB_DIR=str(lib)).stdout.split()
    assert out == [str(lib / _init_name(venv)), "True"]
    assert (lib / _init_name(venv)).stat().st_size > 0


def test_install_service_under_a_root(built: Built, tmp_path: Path) -> None:
    venv, root = built.venvs["wheel"], tmp_path / "root"
    crabctl = [str(venv / "bin" / "crabctl"), "host", "install-service", "--root", str(root), "--no-start"]
    dry = _run([*crabctl, "--dry-run"], cwd=tmp_path).stdout
    assert dry.count("would write: ") == 4 and not root.exists()
    _run(crabctl, cwd=tmp_path)
    unit = (root / "etc/systemd/system/crabd.service").read_text()
    assert f"ExecStart={venv}/bin/crabd --config /etc/crab/crabd.toml" in unit
    for target in ("usr/lib/sysusers.d/crab.conf", "usr/lib/tmpfiles.d/crab.conf", "etc/crab/crabd.toml"):
        assert (root / target).is_file(), target
    again = _run([*crabctl, "--json"], cwd=tmp_path).stdout
    assert {f["action"] for f in json.loads(again)["files"]} == {"keep"}
