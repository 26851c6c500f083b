"""crabd's configuration: pydantic models read from one TOML file.

The file is ``/etc/crab/crabd.toml`` unless ``--config`` or ``$CRAB_CONFIG``
names another.  A missing file means "all defaults".  Unknown keys are an
error (``extra="forbid"``), so a typo never silently falls back to a
default.  Every default is documented in ``docs/config.md``.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crabd.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/crab/crabd.toml")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PathsConfig(_Model):
    """Where crabd keeps its socket, state and logs."""

    socket: Path = Field(Path("/run/crab/crabd.sock"), description="gRPC unix socket")
    state_dir: Path = Field(Path("/var/lib/crab"), description="registry, checkpoints, blobs")
    log_dir: Path = Field(Path("/var/log/crab"), description="crabd and helper logs")


class DockerConfig(_Model):
    """How crabd reaches the Docker engine."""

    host: str | None = Field(None, description="Docker endpoint; None means $DOCKER_HOST or the default socket")
    timeout_s: float = Field(60.0, gt=0, description="per-request timeout towards dockerd")


class DoctorConfig(_Model):
    """Thresholds used by `crabctl doctor`."""

    min_free_gib: float = Field(2.0, ge=0, description="fail below this much free space in state_dir")
    warn_free_gib: float = Field(10.0, ge=0, description="warn below this much free space in state_dir")


class LimitsConfig(_Model):
    """Bounds on what one request may ask of crabd."""

    max_command_bytes: int = Field(1 << 20, gt=0, description="argv+env of an exec, or a session command's text")
    max_stdin_bytes: int = Field(8 << 20, ge=0, description="stdin attached to one exec")
    default_timeout_s: float = Field(600.0, gt=0, description="command timeout when the request gives none")
    max_timeout_s: float = Field(86400.0, gt=0, description="largest timeout a request may ask for")
    default_max_output_bytes: int = Field(1 << 20, gt=0, description="kept per stream when the request gives none")
    max_output_bytes: int = Field(64 << 20, gt=0, description="largest per-stream output a request may keep")
    stop_timeout_s: float = Field(10.0, ge=0, description="grace before SIGKILL when stopping a sandbox")


class CheckpointConfig(_Model):
    """Bounds and tuning of filesystem checkpoints."""

    max_entries: int = Field(500_000, gt=0, description="most files/dirs one sandbox's changes may hold")
    max_depth: int = Field(1000, gt=0, le=4000, description="deepest directory nesting captured")
    zstd_level: int = Field(3, ge=1, le=19, description="compression level of stored blobs")
    page_cache_entries: int = Field(1_000_000, ge=0, description="decoded index entries kept in memory")


class CriuConfig(_Model):
    """How crabd dumps processes (through runc and CRIU)."""

    runc: str = Field("runc", description="runc binary (found on PATH unless absolute)")
    runc_root: Path = Field(Path("/run/docker/runtime-runc/moby"), description="runc state dir of Docker's containers")
    timeout_s: float = Field(300.0, gt=0, description="longest one dump may take")
    busy_wait_s: float = Field(10.0, ge=0, description="how long a process checkpoint waits for running commands")


class InspectorConfig(_Model):
    """How crabd decides what each turn needs (see docs/inspector.md)."""

    mode: Literal["auto", "ebpf", "scan"] = Field(
        "auto",
        description="auto: the eBPF probes if they load, else the scan inspector; "
        "ebpf: the probes or crabd does not start; scan: no probes (walk the upper dir and /proc every turn)",
    )
    shadow: bool = Field(False, description="also run the scan inspector at every turn end and record its verdict")
    ring_buffer_pages: int = Field(1024, ge=16, description="pages of the probes' ring buffer (a power of two)")


class CrabConfig(_Model):
    """The whole configuration file."""

    paths: PathsConfig = PathsConfig()
    docker: DockerConfig = DockerConfig()
    doctor: DoctorConfig = DoctorConfig()
    limits: LimitsConfig = LimitsConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    criu: CriuConfig = CriuConfig()
    inspector: InspectorConfig = InspectorConfig()


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The config file in force: ``explicit``, else ``$CRAB_CONFIG``, else the default."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get("CRAB_CONFIG")
    return Path(env) if env else DEFAULT_CONFIG_PATH


def load_config(path: str | os.PathLike[str] | None = None, *, overrides: dict[str, Any] | None = None) -> CrabConfig:
    """Read and validate the configuration.

    ``overrides`` is a nested dict merged over the file (used by command-line
    flags such as ``--state-dir``).
    """
    p = config_path(path)
    data: dict[str, Any] = {}
    if p.exists():
        try:
            with p.open("rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read {p}: {exc}", path=str(p)) from exc
    elif path is not None:
        raise ConfigError(f"config file {p} does not exist", path=str(p), hint="Create it or drop --config.")
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update(values)
    try:
        return CrabConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"invalid configuration in {p}: {problems}", path=str(p)) from exc
