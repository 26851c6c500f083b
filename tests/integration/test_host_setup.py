"""The provisioned host: doctor, images, the set-up script's idempotence."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from crabd.host import criu_kdat, images
from crabd.util import proc
from tests.conftest import CRABCTL, REPO


def doctor_json(env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    done = subprocess.run([CRABCTL, "doctor", "--json"], capture_output=True, text=True, timeout=300, env=env)
    return done.returncode, json.loads(done.stdout)


def by_name(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in report["checks"]}


@pytest.mark.criu
@pytest.mark.bpf
def test_doctor_reports_every_check_ok() -> None:
    code, report = doctor_json()
    bad = {c["name"]: c["summary"] for c in report["checks"] if c["status"] != "ok"}
    assert bad == {}  # user namespaces included: on by default (docs/runc.md)
    assert code == 0 and report["ok"] is True
    assert set(by_name(report)) == {
        "root",
        "kernel",
        "tracefs",
        "docker",
        "criu",
        "runc-criu",
        "criu-config",
        "criu-kdat",
        "conntrack",
        "checkpoints",
        "bcc",
        "overlay",
        "cgroups",
        "disk",
        "inspector",
        "btrfs-pool",
        "backend",
        "userns",
        "remote",
    }
    # In CI the eBPF inspector must be the one crabd runs, never a silent fallback.
    assert by_name(report)["inspector"]["summary"].startswith("ebpf:")


@pytest.mark.criu
def test_criu_loads_the_kernel_feature_cache_crab_made(crab_tmp: Path) -> None:
    """Where /run is a disk (this machine kind), crab's cache is what spares CRIU its ~40 ms kernel probe."""
    criu = shutil.which("criu")
    assert criu is not None
    made = criu_kdat.ensure(criu)
    for attempt in ("first", "second"):  # where /run is a tmpfs, CRIU's first run saves the cache itself
        log = crab_tmp / f"check-{attempt}.log"
        proc.run([criu, "check", "-v4", "-o", str(log)], timeout=60, check=False)
    assert f"Loaded kdat cache from {criu_kdat.KDAT}" in log.read_text(), made.detail
    assert criu_kdat.status().state is not criu_kdat.KdatState.ABSENT


def test_doctor_names_missing_criu() -> None:
    # Hide every criu from PATH, keep everything else.
    dirs = [d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "criu").exists()]
    env = dict(os.environ, PATH=os.pathsep.join(dirs))
    code, report = doctor_json(env)
    assert code != 0 and report["ok"] is False
    criu = by_name(report)["criu"]
    assert criu["status"] == "fail"
    assert "criu is not on PATH" in criu["summary"]
    assert "make setup" in criu["fix"]
    # Only the criu check is affected: docker is still reachable.
    assert by_name(report)["docker"]["status"] == "ok"


def test_doctor_names_unreachable_dockerd(crab_tmp: Path) -> None:
    nowhere = crab_tmp / "no-docker.sock"
    env = dict(os.environ, DOCKER_HOST=f"unix://{nowhere}")
    code, report = doctor_json(env)
    assert code != 0
    docker_check = by_name(report)["docker"]
    assert docker_check["status"] == "fail"
    assert str(nowhere) in docker_check["summary"]
    assert "dockerd" in docker_check["fix"]
    assert by_name(report)["overlay"]["status"] == "fail"


def test_doctor_human_output_and_exit_code() -> None:
    done = subprocess.run([CRABCTL, "doctor"], capture_output=True, text=True, timeout=300)
    assert "criu" in done.stdout and "docker" in done.stdout
    assert done.returncode == (0 if "all required checks passed" in done.stdout else 1)


@pytest.mark.parametrize(
    ("env", "argv", "expect"),
    [
        ("busybox", ["sh", "-c", "echo hello from busybox"], "hello from busybox"),
        ("bookworm", ["bash", "-c", "python3 -c 'print(6*7)'; git --version; ps -p 1 -o comm="], "42"),
    ],
)
def test_env_images_are_built_and_run(env: str, argv: list[str], expect: str) -> None:
    recipe = images.find_recipe(env)
    assert images.image_exists(recipe.image_ref), f"{recipe.image_ref} not built; run `make images`"
    name = f"crab-test-img-{env}-{os.getpid()}"
    try:
        done = subprocess.run(
            ["docker", "run", "--name", name, "--network", "none", recipe.image_ref, *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert expect in done.stdout


def test_env_build_skips_unchanged_recipes() -> None:
    done = subprocess.run([CRABCTL, "env", "build", "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert {r["env"] for r in results} >= {"bookworm", "busybox"}
    assert all(r["built"] is False for r in results)


def test_env_build_rebuilds_a_changed_recipe(crab_tmp: Path) -> None:
    src = images.find_recipe("busybox").directory
    work = crab_tmp / "recipes" / "busybox"
    shutil.copytree(src, work)
    (work / "rootfs" / "etc").mkdir(parents=True)
    (work / "rootfs" / "etc" / "motd").write_text(f"test {os.getpid()}\n")
    recipe = images.load_recipe(work)
    try:
        ref, built = images.build(recipe)
        assert built and images.image_exists(ref)
        assert images.build(recipe) == (ref, False)
        out = subprocess.run(
            ["docker", "run", "--rm", ref, "cat", "/etc/motd"], capture_output=True, text=True, timeout=60
        )
        assert out.stdout == f"test {os.getpid()}\n"
    finally:
        subprocess.run(["docker", "image", "rm", "-f", recipe.image_ref], capture_output=True, timeout=60)


def test_setup_host_second_run_installs_nothing() -> None:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup-host.sh")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    log = done.stderr
    for word in ("installing", "provisioning", "unpacking", "starting dockerd", "created"):
        assert word not in log, log
    assert "host ready" in log
