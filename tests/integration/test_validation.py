"""Bad input at the one edge: a raw gRPC client (no SDK checks) and the SDK both get InvalidRequest.

Each bad request must change nothing: no sandbox created, none stopped, no
turn opened, no command run.  And a command's result always fits a gRPC
message, whatever both streams produced.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from crabd.api import errors as wire_errors
from crabd.api.v1 import crab_pb2 as pb
from crabd.api.v1 import crab_pb2_grpc as pb_grpc
from crabd.config import CrabConfig
from crabd.errors import CrabError, InvalidRequest
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from crabd.sdk import _requests as rq
from tests.integration.conftest import container_limits, instance_containers

NOT_FINITE = [math.nan, math.inf, -math.inf]


@pytest.fixture
def stub(daemon: EmbeddedDaemon) -> Iterator[pb_grpc.CrabStub]:
    """A raw client: whatever it sends reaches crabd unchecked."""
    channel = grpc.insecure_channel(f"unix:{daemon.socket}", options=rq.CHANNEL_OPTIONS)
    try:
        yield pb_grpc.CrabStub(channel)
    finally:
        channel.close()


def raw_error(method: Callable[..., Any], request: Any) -> CrabError:
    """The CrabError crabd answered ``request`` with (it must fail)."""
    try:
        result = method(request, timeout=60)
        if hasattr(result, "__iter__") and not isinstance(result, bytes):
            list(result)  # a server stream fails on reading
    except grpc.RpcError as exc:
        return wire_errors.decode(exc)
    raise AssertionError("crabd accepted a bad request")


def containers(daemon: EmbeddedDaemon) -> set[str]:
    return instance_containers(daemon.state_dir)


def test_raw_create_with_bad_limits_creates_nothing(
    daemon: EmbeddedDaemon, client: Client, stub: pb_grpc.CrabStub
) -> None:
    sandboxes, made = {s.id for s in client.list()}, containers(daemon)
    bad = [pb.Limits(cpus=v) for v in NOT_FINITE] + [
        pb.Limits(cpus=-1),
        pb.Limits(memory_bytes=-1),
        pb.Limits(memory_bytes=1 << 62),
        pb.Limits(pids=10**9),
        pb.Limits(pids=-1),
    ]
    for limits in bad:
        err = raw_error(stub.CreateSandbox, pb.CreateSandboxRequest(env="busybox", limits=limits))
        assert isinstance(err, InvalidRequest), (limits, err)
    # The maximum is in the message, not runc's text about cgroups.
    err = raw_error(stub.CreateSandbox, pb.CreateSandboxRequest(env="busybox", limits=pb.Limits(pids=10**9)))
    assert "maximum of 4096" in err.message
    for env in ({"A=B": "1"}, {"": "1"}, {"A": "x\0y"}):
        err = raw_error(stub.CreateSandbox, pb.CreateSandboxRequest(env="busybox", env_vars=env))
        assert isinstance(err, InvalidRequest), (env, err)
    assert {s.id for s in client.list()} == sandboxes
    assert containers(daemon) == made


def test_raw_command_values_are_refused_before_anything_runs(
    client: Client, stub: pb_grpc.CrabStub, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox("busybox")
    sandboxes = {s.id for s in client.list()}
    turns = [(t.number, len(t.commands)) for t in sb.turns()]
    requests: list[tuple[str, Any]] = []
    for t in NOT_FINITE:
        # A NaN timeout used to pass the range check and never kill the command.
        requests.append(("Exec", pb.ExecRequest(sandbox=sb.id, argv=["touch", "/ran"], timeout_s=t)))
        requests.append(("SessionRun", pb.SessionRunRequest(sandbox=sb.id, command="touch /ran", timeout_s=t)))
        requests.append(("StopSandbox", pb.StopSandboxRequest(sandbox=sb.id, timeout_s=t)))
    for env in ({"A=B": "1"}, {"": "1"}, {"A": "x\0y"}, {"A\0": "1"}):
        requests.append(("Exec", pb.ExecRequest(sandbox=sb.id, argv=["touch", "/ran"], env=env)))
    requests += [
        ("Exec", pb.ExecRequest(sandbox=sb.id, argv=["touch", "/ran"], max_output_bytes=-1)),
        ("StopSandbox", pb.StopSandboxRequest(sandbox=sb.id, timeout_s=10**6)),
        ("ListTurns", pb.ListTurnsRequest(sandbox=sb.id, limit=-1)),
        ("Fork", pb.ForkRequest(sandbox=sb.id, n=0)),
        ("Fork", pb.ForkRequest(sandbox=sb.id, n=1000)),
        ("Restore", pb.RestoreRequest(sandbox=sb.id, turn=-7)),
        (
            "RestartSession",
            pb.RestartSessionRequest(sandbox=sb.id, state_json=json.dumps({"cwd": "/", "env": {"A=B": "1"}})),
        ),
        (
            "RestartSession",
            pb.RestartSessionRequest(sandbox=sb.id, state_json=json.dumps({"cwd": "/", "env": {"A": "x\0"}})),
        ),
    ]
    for method, request in requests:
        err = raw_error(getattr(stub, method), request)
        assert isinstance(err, InvalidRequest), (method, request, err)
    # Nothing ran, nothing stopped, no turn opened, no sandbox forked.
    assert sb.refresh().state == "running"
    assert [(t.number, len(t.commands)) for t in sb.turns()] == turns
    assert sb.run(["test", "-e", "/ran"]).exit_code == 1
    assert {s.id for s in client.list()} == sandboxes


def test_sdk_says_invalid_request_not_daemon_unavailable(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    before = {s.id for s in client.list()}
    for t in NOT_FINITE:
        with pytest.raises(InvalidRequest):
            sb.run(["true"], timeout=t)
        with pytest.raises(InvalidRequest):
            sb.session.run("true", timeout=t)
        with pytest.raises(InvalidRequest):
            sb.stop(timeout=t)
        with pytest.raises(InvalidRequest):
            client.create("busybox", cpus=t)
    with pytest.raises(InvalidRequest, match="maximum of 4096"):
        client.create("busybox", pids=10**9)
    with pytest.raises(InvalidRequest, match="environment"):
        sb.run(["true"], env={"A=B": "1"})
    assert {s.id for s in client.list()} == before
    assert sb.refresh().state == "running"


def test_memory_zero_means_the_default_not_unlimited(make_sandbox: Callable[..., Sandbox]) -> None:
    default = CrabConfig().limits.default_memory_bytes
    sb = make_sandbox("busybox")  # memory not given: 0 on the wire
    assert sb.info.memory_bytes == default
    limits = container_limits(sb.info.container_id)
    assert (limits["memory"], limits["pids"]) == (default, 4096)


def test_two_full_streams_still_fit_one_reply(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    big = 64 << 20
    budget = CrabConfig().limits.max_reply_output_bytes
    # Both streams at the per-stream maximum: 128 MiB, more than the 80 MiB a
    # gRPC message may hold.  The command has run; its result must still arrive.
    r = sb.run(["sh", "-c", f"head -c {big} /dev/zero; head -c {big} /dev/zero >&2"], max_output=big, timeout=120)
    assert r.exit_code == 0
    assert len(r.stdout) + len(r.stderr) <= budget
    kept_out = r.stdout.index(b"\n[crab: stdout truncated")
    kept_err = r.stderr.index(b"\n[crab: stderr truncated")
    assert kept_out + r.stdout_dropped == big and kept_err + r.stderr_dropped == big
    assert r.stdout_dropped > 0 and r.stderr_dropped > 0
