"""LLM serving for tests and benchmarks: a paced OpenAI-compatible stand-in (no GPU needed).

Real vLLM is run with scripts/vllm-serve.sh; see docs/llm.md.
"""

from __future__ import annotations

from crabd.llm.latency import (
    LatencyModel,
    LatencySample,
    RequestPlan,
    ScriptedToolCall,
    ScriptEntry,
    ScriptError,
    load_latency,
    load_script,
    plan_request,
    request_rng,
    routing_key,
)
from crabd.llm.standin import DEFAULT_MODEL, ServedRequest, StandinServer

__all__ = [
    "DEFAULT_MODEL",
    "LatencyModel",
    "LatencySample",
    "RequestPlan",
    "ScriptEntry",
    "ScriptError",
    "ScriptedToolCall",
    "ServedRequest",
    "StandinServer",
    "load_latency",
    "load_script",
    "plan_request",
    "request_rng",
    "routing_key",
]
