"""Errors of the host and its tools: configuration, missing capabilities, subprocesses,
the container runtimes (Docker, runc and CNI), sandbox images and eBPF probes."""

from __future__ import annotations

from collections.abc import Sequence

from crabd.errors.base import CrabError


class ConfigError(CrabError):
    """The configuration file or a setting is invalid.  Attribute: ``path`` (the file, "" if none)."""

    grpc_code = "INVALID_ARGUMENT"
    default_hint = "Fix the named setting in crabd.toml (see docs/config.md)."

    def __init__(self, message: str, *, path: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


class HostError(CrabError):
    """The host lacks a capability crab needs (root, kernel feature, tool)."""

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "Run `make setup` as root, then `crabctl doctor` to see what is missing."


class CommandError(CrabError):
    """A host subprocess failed or timed out.

    Attributes: ``argv``, ``exit_code`` (None on timeout), ``stderr`` (tail).
    """

    default_hint = "Read the stderr excerpt above; the command is shown exactly as crab ran it."

    def __init__(
        self, message: str, *, argv: Sequence[str], exit_code: int | None, stderr: str, hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.argv = tuple(argv)
        self.exit_code = exit_code
        self.stderr = stderr


class CommandTimeout(CommandError):
    """A host subprocess did not finish within its timeout."""

    grpc_code = "DEADLINE_EXCEEDED"


class DockerError(CrabError):
    """The Docker engine refused or failed a request.  Attribute: ``status`` (its HTTP status, if it answered)."""

    grpc_code = "UNAVAILABLE"
    default_hint = "Check that dockerd runs (`docker info`) and see its log."

    def __init__(self, message: str, *, status: int | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status


class ContainerRuntimeError(CrabError):
    """runc (crab's own bundles) or a CNI plugin refused or failed a request.  Attribute: ``container``."""

    grpc_code = "UNAVAILABLE"
    default_hint = "Read the runtime's message above; `crabctl doctor` checks runc and the CNI plugins."

    def __init__(self, message: str, *, container: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.container = container


class ImageError(CrabError):
    """A sandbox image is missing or could not be built.  Attribute: ``env``."""

    grpc_code = "NOT_FOUND"
    default_hint = "Build the env images with `make images` (or `crabctl env build`)."

    def __init__(self, message: str, *, env: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.env = env


class BpfError(CrabError):
    """bcc could not compile, load or attach a probe."""

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "Check kernel headers and tracefs with `crabctl doctor`."
