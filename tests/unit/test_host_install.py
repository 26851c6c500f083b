"""Installing crab without a checkout: shipped files, `crabctl host setup`'s plan, `install-service`'s files.

The built wheel and sdist themselves are checked by tests/integration/test_packaging.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest

from crabd.errors import HostError
from crabd.host import images, provision, service_install
from crabd.runtime import initbin
from crabd.util import resources
from tests.conftest import REPO

UNIT = (REPO / "systemd" / "crabd.service").read_text()


@pytest.fixture
def installed_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Pretend this is an installed package: a crabd/_data of its own, crab-init's lib dir in tmp."""
    data = tmp_path / "_data"
    data.mkdir()
    monkeypatch.setattr(resources, "DATA_DIR", data)
    monkeypatch.setenv("CRAB_LIB_DIR", str(tmp_path / "lib"))
    return data


# --- resources --------------------------------------------------------------------------------


def test_checkout_layout_finds_every_shipped_file_in_the_checkout() -> None:
    assert not resources.installed()  # tests run from an editable install of the checkout
    for rel in resources.SHIPPED:
        assert resources.path(rel) == REPO / rel
        assert resources.path(rel).exists(), rel
    assert resources.inspector_program() == REPO / "ebpf" / "inspector.c"
    assert resources.env_recipes_dir() == REPO / "envs" / "images"
    assert resources.setup_script() == REPO / "scripts" / "setup-host.sh"
    assert resources.crab_init_source().is_file()
    assert resources.crab_init_binary() == REPO / "crabd" / "runtime" / "init" / "crab-init"


def test_installed_layout_reads_the_package_copy(installed_layout: Path, tmp_path: Path) -> None:
    assert resources.installed()
    assert resources.systemd_file("crabd.service") == installed_layout / "systemd" / "crabd.service"
    assert resources.path("envs/images/bookworm/image.toml") == installed_layout / "envs/images/bookworm/image.toml"
    digest = hashlib.sha256(resources.crab_init_source().read_bytes()).hexdigest()[:12]
    assert resources.crab_init_binary() == tmp_path / "lib" / f"crab-init-{digest}"


def test_only_shipped_paths_resolve() -> None:
    for rel in ("envs/tasks", "ebpf", "systemd/crabd.service.d", "README.md", "envs/imagesX"):
        with pytest.raises(ValueError):
            resources.path(rel)


def test_no_module_finds_a_shipped_file_behind_resources_back() -> None:
    """Every lookup of a data file goes through crabd.util.resources (a wheel has no checkout around it)."""
    offenders = []
    for path in (REPO / "crabd").rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or path == REPO / "crabd/util/resources.py":
            continue
        text = path.read_text()
        if re.search(r"parents\[\d\]", text) or re.search(r"""["'](ebpf|envs|systemd|scripts)["']\s*/""", text):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_manifest_puts_every_shipped_file_in_the_sdist() -> None:
    manifest = (REPO / "MANIFEST.in").read_text()
    for rel in resources.SHIPPED:
        assert rel in manifest, f"MANIFEST.in lacks {rel}"
    assert "crabd/runtime/init/crab-init.c" in manifest


def test_resources_imports_only_the_standard_library() -> None:
    """setup.py loads it by path, before crabd's dependencies exist."""
    text = (REPO / "crabd/util/resources.py").read_text()
    assert not re.search(r"^\s*(from|import) crabd", text, re.M)


def test_installed_crab_init_is_fresh_by_its_name(installed_layout: Path) -> None:
    target = initbin.binary_path()
    assert not initbin.is_built()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\x7fELF")
    os.utime(target, (0, 0))  # older than its source: the name, not the time, says it is current
    assert initbin.is_built()


# --- crabctl host setup ----------------------------------------------------------------------------


def test_would_lines_are_the_dry_runs_changes() -> None:
    log = (
        "[setup-host] apt packages: present\n"
        "[setup-host] would install apt packages: gcc libc6-dev\n"
        "  [setup-host] would start dockerd --experimental (log: /var/log/crab/dockerd.log)\n"
        "[setup-host] dry run: nothing was changed\n"
    )
    assert provision.would_lines(log) == [
        "install apt packages: gcc libc6-dev",
        "start dockerd --experimental (log: /var/log/crab/dockerd.log)",
    ]
    assert provision.would_lines("[setup-host] host ready\n") == []


def test_script_env_sets_dry_run_only_when_asked() -> None:
    assert provision.script_env(True, {"PATH": "/bin"}) == {"PATH": "/bin", "CRAB_DRY_RUN": "1"}
    assert provision.script_env(False, {"PATH": "/bin", "CRAB_DRY_RUN": "1"}) == {"PATH": "/bin"}


def test_every_script_step_honours_dry_run() -> None:
    """Each ensure_* step of the host script returns before changing anything under CRAB_DRY_RUN=1."""
    script = (REPO / "scripts" / "setup-host.sh").read_text()
    bodies = re.findall(r"^(ensure_\w+)\(\) \{\n(.*?)^\}", script, re.M | re.S)
    assert len(bodies) >= 8
    for name, body in bodies:
        assert "if dry_run; then" in body and "would " in body, f"{name} has no dry-run branch"
    top = script[script.index('[ "$(id -u)" -eq 0 ]') :]
    assert re.search(r"if ! dry_run; then\n\s+mkdir -p", top)


def _recipe(name: str) -> images.Recipe:
    return images.Recipe(name=name, builder="busybox", directory=REPO / "envs" / "images" / "busybox")


def test_plan_images_lists_what_the_engine_lacks() -> None:
    a, b = _recipe("a"), _recipe("b")
    assert provision.plan_images([a, b], lambda ref: ref.startswith("crab-env/a:"), engine_up=True) == (
        f"build {b.image_ref}",
    )
    assert provision.plan_images([a], lambda ref: True, engine_up=True) == ()
    down = provision.plan_images([a, b], lambda ref: True, engine_up=False)
    assert len(down) == 2 and "does not answer" in down[0]


def test_host_commands_need_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(HostError, match="must run as root"):
        provision.setup(dry_run=True, skip_images=True, echo=lambda line: None)
    with pytest.raises(HostError, match="must run as root"):
        service_install.install(root=Path("/"), prefix=None, dry_run=False)


# --- crabctl host install-service ---------------------------------------------------------------


def test_exec_start_names_the_given_crabd_and_keeps_its_arguments() -> None:
    unit = service_install.rewrite_exec_start(UNIT, Path("/srv/crab env/bin/crabd"))
    lines = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert lines == ['ExecStart="/srv/crab env/bin/crabd" --config /etc/crab/crabd.toml']
    assert "/opt/crab/venv" not in unit
    # Everything else is the repository's unit, line for line (plus one comment).
    assert len(unit.splitlines()) == len(UNIT.splitlines()) + 1
    assert unit.replace(lines[0], "").count("ExecStart") == UNIT.replace("ExecStart=", "").count("ExecStart") + 1


def test_exec_start_keeps_flags_and_escapes_specifiers() -> None:
    unit = "[Service]\nExecStart=-/old/crabd --a b\nUser=root\n"
    assert "ExecStart=-/v%%1/bin/crabd --a b\n" in service_install.rewrite_exec_start(unit, Path("/v%1/bin/crabd"))


@pytest.mark.parametrize("unit", ["[Service]\nUser=root\n", "ExecStart=/a\nExecStart=/b\n"])
def test_exec_start_must_be_one_line(unit: str) -> None:
    with pytest.raises(HostError, match="ExecStart"):
        service_install.rewrite_exec_start(unit, Path("/x/crabd"))


def _env(tmp_path: Path) -> Path:
    crabd = tmp_path / "env" / "bin" / "crabd"
    crabd.parent.mkdir(parents=True)
    crabd.write_text("#!/bin/sh\n")
    crabd.chmod(0o755)
    return tmp_path / "env"


def test_crabd_executable_of_a_prefix(tmp_path: Path) -> None:
    env = _env(tmp_path)
    assert service_install.crabd_executable(env) == env / "bin" / "crabd"
    with pytest.raises(HostError, match="no crabd executable"):
        service_install.crabd_executable(tmp_path / "nowhere")


def test_install_under_a_root_is_idempotent_and_keeps_the_config(tmp_path: Path) -> None:
    root, env = tmp_path / "root", _env(tmp_path)
    planned = service_install.install(root=root, prefix=env, dry_run=True)
    assert [f.action for f in planned.files] == [service_install.Action.CREATE] * 4
    assert not root.exists()  # a dry run writes nothing

    first = service_install.install(root=root, prefix=env)
    unit = root / "etc/systemd/system/crabd.service"
    assert f"ExecStart={env}/bin/crabd --config /etc/crab/crabd.toml" in unit.read_text()
    assert (root / "usr/lib/sysusers.d/crab.conf").read_bytes() == (REPO / "systemd/crab.sysusers").read_bytes()
    assert (root / "usr/lib/tmpfiles.d/crab.conf").read_bytes() == (REPO / "systemd/crab.tmpfiles").read_bytes()
    assert oct(unit.stat().st_mode & 0o777) == "0o644"
    assert first.commands == [] and "left to that system" in first.notes[0]

    again = service_install.install(root=root, prefix=env)
    assert {f.action for f in again.files} == {service_install.Action.KEEP}

    config = root / "etc/crab/crabd.toml"
    config.write_text("[paths]\nstate_dir = '/srv/crab'\n")
    unit.write_text(unit.read_text() + "# local edit\n")
    plan = {f.target: f.action for f in service_install.install(root=root, prefix=env, dry_run=True).files}
    assert plan[service_install.UNIT] is service_install.Action.REPLACE
    assert plan[service_install.CONFIG] is service_install.Action.KEEP
    service_install.install(root=root, prefix=env)
    assert config.read_text() == "[paths]\nstate_dir = '/srv/crab'\n"
    assert "# local edit" not in unit.read_text()
    assert list(root.rglob("*.tmp")) == []


def test_default_config_is_valid() -> None:
    import tomllib

    from crabd.config import CrabConfig

    assert CrabConfig.model_validate(tomllib.loads(service_install.DEFAULT_CONFIG)) == CrabConfig()


def test_service_is_started_only_where_systemd_is_pid1(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env = _env(tmp_path)
    monkeypatch.setattr(service_install, "group_exists", lambda name="crab": False)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    ran: list[list[str]] = []

    def plan(**kw: object) -> service_install.Report:
        return service_install.install(root=Path("/"), prefix=env, dry_run=True, run=ran.append, **kw)  # type: ignore[arg-type]

    on = plan(systemd=True)
    assert on.commands == [
        "groupadd --system crab",
        "systemd-tmpfiles --create /usr/lib/tmpfiles.d/crab.conf",
        "systemctl daemon-reload",
        "systemctl enable --now crabd",
    ]
    off = plan(systemd=False)
    assert off.commands == ["groupadd --system crab"] and "systemd is not running here" in off.notes[0]
    assert plan(systemd=True, start=False).commands == ["groupadd --system crab"]
    assert ran == []  # a dry run runs nothing


def test_group_comes_from_sysusers_where_it_exists() -> None:
    assert service_install.group_argv(lambda tool: f"/usr/bin/{tool}") == [
        "systemd-sysusers",
        "/usr/lib/sysusers.d/crab.conf",
    ]
    assert service_install.group_argv(lambda tool: None) == ["groupadd", "--system", "crab"]


def test_systemd_detection(tmp_path: Path) -> None:
    assert not service_install.systemd_is_pid1(tmp_path / "absent")
    assert service_install.systemd_is_pid1(tmp_path)
