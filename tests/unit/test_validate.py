"""Request validation: the shared rules, the service's [limits], the SDK's builders, bounded results."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from crabd.api.convert import outcome_to_pb
from crabd.config import CrabConfig, LimitsConfig, load_config
from crabd.coordinator.oneshot import truncation_marker
from crabd.errors import ConfigError, InvalidRequest
from crabd.models import ExecOutcome, SandboxSpec
from crabd.sdk import Client
from crabd.sdk import _requests as rq
from crabd.service.limits import RequestLimits, fit_output, host_cpus
from crabd.util import validate

NOT_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("bad", [*NOT_FINITE, -1.0, 86400.5, True, "5", None])
def test_seconds_rejects(bad: object) -> None:
    with pytest.raises(InvalidRequest):
        validate.seconds(bad, "timeout", maximum=86400)


def test_seconds_accepts_and_names_the_maximum() -> None:
    assert validate.seconds(0, "timeout", maximum=10) == 0.0
    assert validate.seconds(2.5, "timeout", maximum=10) == 2.5
    with pytest.raises(InvalidRequest, match="maximum of 10 s"):
        validate.seconds(11, "timeout", maximum=10)


@pytest.mark.parametrize("bad", [*NOT_FINITE, -1, 1.5, 10**6])
def test_integer_rejects(bad: object) -> None:
    with pytest.raises(InvalidRequest):
        validate.integer(bad, "pids", maximum=1000)


def test_integer_accepts_integral_floats() -> None:
    assert validate.integer(3.0, "n") == 3
    assert validate.integer(0, "n") == 0


@pytest.mark.parametrize("bad", [*NOT_FINITE, -0.5, 3.0])
def test_fraction_rejects(bad: float) -> None:
    with pytest.raises(InvalidRequest, match="cpus"):
        validate.fraction(bad, "cpus", maximum=2)


@pytest.mark.parametrize(
    "env",
    [
        {"": "x"},
        {"A=B": "x"},
        {"A\0B": "x"},
        {"1A": "x"},
        {"A B": "x"},
        {"A": "x\0y"},
        {"A": 1},
        {5: "x"},
        ["A=1"],
    ],
)
def test_env_vars_rejects(env: object) -> None:
    with pytest.raises(InvalidRequest, match="environment"):
        validate.env_vars(env)  # type: ignore[arg-type]


def test_env_vars_accepts() -> None:
    env = {"A": "", "_b1": "x=y", "PATH": "/bin:/usr/bin", "U": "ünïcode"}
    assert validate.env_vars(env) == env


# --- the service's [limits] ---------------------------------------------------------


def test_request_limits_timeouts() -> None:
    lim = RequestLimits(LimitsConfig())
    for bad in NOT_FINITE:
        with pytest.raises(InvalidRequest):
            lim.timeout(bad)
        with pytest.raises(InvalidRequest):
            lim.stop_timeout(bad)
    assert lim.timeout(0) == 600.0
    assert lim.stop_timeout(0) == 10.0
    with pytest.raises(InvalidRequest, match="maximum of 600 s"):
        lim.stop_timeout(601)


def test_request_limits_resources() -> None:
    lim = RequestLimits(LimitsConfig(max_memory_bytes=8 << 30, default_memory_bytes=1 << 30))
    got = lim.resources(SandboxSpec(env="x"))
    # 0 is the configured default, never "no limit".
    assert got.memory_bytes == 1 << 30 and got.pids == 4096 and got.cpus == 0
    for cpus in NOT_FINITE:
        with pytest.raises(InvalidRequest, match="cpus"):
            lim.resources(SandboxSpec(env="x", cpus=cpus))
    with pytest.raises(InvalidRequest, match=f"at most {host_cpus():g}"):
        lim.resources(SandboxSpec(env="x", cpus=host_cpus() + 1))
    with pytest.raises(InvalidRequest, match="maximum of 4096"):
        lim.resources(SandboxSpec(env="x", pids=10**9))
    with pytest.raises(InvalidRequest, match=f"maximum of {8 << 30} bytes"):
        lim.resources(SandboxSpec(env="x", memory_bytes=9 << 30))
    with pytest.raises(InvalidRequest, match="too small"):
        lim.resources(SandboxSpec(env="x", memory_bytes=1))
    with pytest.raises(InvalidRequest):
        lim.resources(SandboxSpec(env="x", memory_bytes=-1))
    asked = lim.resources(SandboxSpec(env="x", cpus=0.5, memory_bytes=64 << 20, pids=64))
    assert (asked.cpus, asked.memory_bytes, asked.pids) == (0.5, 64 << 20, 64)


def test_default_memory_never_exceeds_the_maximum() -> None:
    lim = RequestLimits(LimitsConfig(max_memory_bytes=64 << 20, default_memory_bytes=64 << 20))
    assert lim.resources(SandboxSpec(env="x")).memory_bytes == 64 << 20


@pytest.mark.parametrize(
    "text",
    [
        "[limits]\nmax_timeout_s = inf\n",
        "[limits]\nmax_timeout_s = nan\n",
        "[limits]\ndefault_timeout_s = 100\nmax_timeout_s = 50\n",
        "[limits]\nmax_pids = 100\n",  # below default_pids
        "[limits]\nmax_reply_output_bytes = 100000000\n",  # would not fit a gRPC message
        "[limits]\nmax_memory_bytes = 1048576\n",
        "[engine]\nbandwidth_mib_s = inf\n",
    ],
)
def test_config_refuses_limits_that_mean_nothing(tmp_path: Path, text: str) -> None:
    f = tmp_path / "crabd.toml"
    f.write_text(text)
    with pytest.raises(ConfigError):
        load_config(f)


# --- bounded results ------------------------------------------------------------------


def _outcome(out: bytes, err: bytes, out_dropped: int = 0, err_dropped: int = 0) -> ExecOutcome:
    if out_dropped:
        out += truncation_marker("stdout", out_dropped)
    if err_dropped:
        err += truncation_marker("stderr", err_dropped)
    return ExecOutcome(0, False, out, err, out_dropped, err_dropped, 1.0)


def test_fit_output_leaves_small_results_alone() -> None:
    o = _outcome(b"a" * 100, b"b" * 100, out_dropped=7)
    assert fit_output(o, 1000) is o


def test_fit_output_two_full_streams_fit_one_message() -> None:
    big = 64 << 20
    o = _outcome(b"o" * big, b"e" * big, out_dropped=5, err_dropped=0)
    budget = CrabConfig().limits.max_reply_output_bytes
    got = fit_output(o, budget)
    assert len(got.stdout) + len(got.stderr) <= budget
    kept_out = got.stdout.index(b"\n[crab")
    kept_err = got.stderr.index(b"\n[crab")
    # Nothing is lost without being counted, and the markers say how much went.
    assert kept_out + got.stdout_dropped == big + 5
    assert kept_err + got.stderr_dropped == big
    assert got.stdout.endswith(truncation_marker("stdout", got.stdout_dropped))
    assert got.stderr.endswith(truncation_marker("stderr", got.stderr_dropped))
    assert abs(kept_out - kept_err) <= 1
    # The reply built from it fits the 80 MiB gRPC limit (the unbounded one did not).
    assert outcome_to_pb(got).ByteSize() < 80 << 20
    assert outcome_to_pb(o).ByteSize() > 80 << 20


def test_fit_output_gives_a_short_stream_all_it_needs() -> None:
    o = _outcome(b"o" * 5000, b"e" * 10)
    got = fit_output(o, 1000 + 256)
    assert got.stderr == b"e" * 10 and got.stderr_dropped == 0
    assert got.stdout.startswith(b"o" * 990) and got.stdout_dropped == 5000 - 990


# --- the SDK checks before sending ------------------------------------------------------


@pytest.mark.parametrize("bad", NOT_FINITE)
def test_sdk_refuses_non_finite_values(bad: float) -> None:
    with pytest.raises(InvalidRequest):
        rq.ExecOptions(["true"], timeout=bad).request("sb", stream=False)
    with pytest.raises(InvalidRequest):
        rq.session_request("sb", "true", timeout=bad)
    with pytest.raises(InvalidRequest):
        rq.stop_request("sb", bad)
    with pytest.raises(InvalidRequest):
        rq.CreateOptions("busybox", cpus=bad).request()
    with pytest.raises(InvalidRequest):
        rq.client_timeout(bad)
    with pytest.raises(InvalidRequest):
        Client("/nonexistent.sock", timeout=bad)


@pytest.mark.parametrize("memory", ["infg", "nanm", "-5m", -1, 1 << 70, 1.5])
def test_sdk_refuses_bad_memory(memory: object) -> None:
    with pytest.raises(InvalidRequest):
        rq.CreateOptions("busybox", memory=memory).request()  # type: ignore[arg-type]


def test_sdk_refuses_bad_counts_and_env() -> None:
    for call in (
        lambda: rq.CreateOptions("busybox", pids=-1).request(),
        lambda: rq.CreateOptions("busybox", pids=1 << 64).request(),
        lambda: rq.CreateOptions("busybox", env_vars={"A=B": "1"}).request(),
        lambda: rq.ExecOptions(["true"], env={"": "x"}).request("sb", stream=False),
        lambda: rq.ExecOptions(["true"], env={"A": "x\0"}).request("sb", stream=False),
        lambda: rq.ExecOptions(["true"], max_output=-1).request("sb", stream=False),
        lambda: rq.fork_count(0),
        lambda: rq.fork_count(1 << 40),
        lambda: rq.turns_request("sb", -1),
        lambda: rq.restore_request("sb", None, -2),
    ):
        with pytest.raises(InvalidRequest):
            call()
    assert rq.ExecOptions(["true"], env={"A": "1"}, timeout=5).request("sb", stream=False).timeout_s == 5
