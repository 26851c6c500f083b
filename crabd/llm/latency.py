"""What the stand-in LLM answers to one request, and how fast: pure and deterministic.

The stand-in server (``crabd.llm.standin``) paces its answers with
``LatencyModel`` so that agents and benchmarks see realistic think time
without a GPU.  The defaults are modelled on published figures for a
~0.5-1.5B model on one datacenter GPU at low concurrency; they were not
measured in this project.  ``plan_request`` combines the model with an
optional script of canned answers (``ScriptEntry``, JSON Lines).

Everything random is drawn from a ``random.Random`` seeded per request from
(server seed, routing key, per-key request index): running the same agents
twice yields the same latency sequence, whatever the interleaving of agents.
The routing key (``routing_key``) says whose request it is.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_FILLER = ("the", "agent", "reads", "a", "file", "runs", "tests", "then", "writes", "small", "patch", "to", "fix", "it")


@dataclass(frozen=True)
class LatencySample:
    """One request's pacing, in wall-clock seconds (``time_scale`` applied).

    ``gaps_s`` holds the wait before each token after the first, so it has
    ``output_tokens - 1`` entries (none for 0 or 1 tokens).
    """

    ttft_s: float
    gaps_s: tuple[float, ...]
    stalled: bool

    @property
    def decode_s(self) -> float:
        return math.fsum(self.gaps_s)

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s


class LatencyModel(BaseModel):
    """Time to first token, decode pacing, tail and output length of one request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_base_s: float = Field(
        default=0.02, ge=0, description="Fixed part of the time to first token (scheduling, first forward pass)."
    )
    prefill_per_token_s: float = Field(
        default=0.00005, ge=0, description="Added to the time to first token per prompt token (prefill)."
    )
    decode_per_token_s: float = Field(
        default=0.006, ge=0, description="Median gap between two output tokens (inter-token latency)."
    )
    decode_jitter_sigma: float = Field(
        default=0.1, ge=0, description="Sigma of a lognormal factor on each inter-token gap (median 1)."
    )
    tail_sigma: float = Field(
        default=0.25, ge=0, description="Sigma of a lognormal factor (median 1) on the whole call."
    )
    stall_probability: float = Field(
        default=0.02, ge=0, le=1, description="Chance that a call is stalled (queueing behind others, preemption)."
    )
    stall_factor: float = Field(default=3.0, ge=1, description="How much slower a stalled call is.")
    time_scale: float = Field(
        default=1.0, ge=0, description="Multiplier on every wait: 1.0 is real time, 0.01 runs 100x faster."
    )
    output_tokens_median: int = Field(
        default=150, ge=1, description="Median output length when neither max_tokens nor a script fixes it."
    )
    output_tokens_sigma: float = Field(default=0.6, ge=0, description="Sigma of the lognormal output length.")
    output_tokens_min: int = Field(default=8, ge=0, description="Lower clip of the sampled output length.")
    output_tokens_max: int = Field(default=1024, ge=1, description="Upper clip of the sampled output length.")

    @model_validator(mode="after")
    def _check_bounds(self) -> LatencyModel:
        if self.output_tokens_min > self.output_tokens_max:
            raise ValueError("output_tokens_min must not exceed output_tokens_max")
        return self

    def sample_output_tokens(self, rng: random.Random) -> int:
        """Output length of a request that does not say how long it wants."""
        raw = round(self.output_tokens_median * rng.lognormvariate(0.0, self.output_tokens_sigma))
        return max(self.output_tokens_min, min(self.output_tokens_max, raw))

    def sample(self, prompt_tokens: int, output_tokens: int, rng: random.Random) -> LatencySample:
        """Pace one request: time to first token and the gap before each later token.

        Draws always happen in the same order and number for given token
        counts, which is what keeps two runs with one seed identical.
        """
        if prompt_tokens < 0 or output_tokens < 0:
            raise ValueError("token counts must be non-negative")
        call = rng.lognormvariate(0.0, self.tail_sigma)
        stalled = rng.random() < self.stall_probability
        if stalled:
            call *= self.stall_factor
        scale = call * self.time_scale
        ttft = (self.prefill_base_s + self.prefill_per_token_s * prompt_tokens) * scale
        gaps = tuple(
            self.decode_per_token_s * rng.lognormvariate(0.0, self.decode_jitter_sigma) * scale
            for _ in range(max(output_tokens - 1, 0))
        )
        return LatencySample(ttft_s=ttft, gaps_s=gaps, stalled=stalled)


class ScriptError(ValueError):
    """A script file that cannot be used; the message names the line."""


class ScriptedToolCall(BaseModel):
    """A function call a scripted chat answer makes (OpenAI ``tool_calls``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="The function's name.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="Its arguments (sent as JSON text).")


class ScriptEntry(BaseModel):
    """One scripted answer (a line of the JSON Lines script)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    content: str | None = Field(default=None, description="Answer text; its word count is the output length.")
    tokens: int | None = Field(default=None, ge=0, description="Output length (truncates or pads 'content').")
    status: int | None = Field(default=None, ge=400, le=599, description="Answer with this HTTP error instead.")
    error: str | None = Field(default=None, description="Message of the error body (with 'status').")
    error_type: str | None = Field(default=None, description="'type' of the error body (default from 'status').")
    delay_s: float = Field(default=0.0, ge=0, description="Extra wait before answering, in real seconds (unscaled).")
    disconnect: bool = Field(default=False, description="Close the connection after half the tokens.")
    tool_calls: tuple[ScriptedToolCall, ...] = Field(
        default=(), description="Chat only: the answer calls these tools (finish_reason 'tool_calls')."
    )

    @model_validator(mode="after")
    def _consistent(self) -> ScriptEntry:
        if (self.error is not None or self.error_type is not None) and self.status is None:
            raise ValueError("'error' and 'error_type' need a 'status'")
        if self.status is not None and (
            self.content is not None or self.tokens is not None or self.disconnect or self.tool_calls
        ):
            raise ValueError(
                "an error entry ('status') cannot also set 'content', 'tokens', 'disconnect' or 'tool_calls'"
            )
        return self


def load_script(path: str | Path) -> tuple[ScriptEntry, ...]:
    """Read and validate a JSON Lines script; blank lines are skipped."""
    entries: list[ScriptEntry] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise ScriptError(f"{where}: not valid JSON: {e.msg}") from None
            if not isinstance(raw, dict):
                raise ScriptError(f"{where}: expected a JSON object, got {type(raw).__name__}")
            try:
                entries.append(ScriptEntry.model_validate(raw))
            except ValidationError as e:
                detail = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'entry'}: {err['msg']}" for err in e.errors())
                raise ScriptError(f"{where}: {detail}") from None
    if not entries:
        raise ScriptError(f"{path}: the script has no entries")
    return tuple(entries)


@dataclass(frozen=True)
class RequestPlan:
    """Everything the server will do for one request, decided before it waits.

    ``pieces`` are the output tokens as text (joined, they are the answer);
    ``latency`` is None for a scripted error.
    """

    entry: ScriptEntry
    output_tokens: int
    finish_reason: str
    pieces: tuple[str, ...]
    latency: LatencySample | None
    response_id: str

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def plan_request(
    model: LatencyModel,
    script: Sequence[ScriptEntry],
    rng: random.Random,
    index: int,
    prompt_tokens: int,
    max_tokens: int | None,
) -> RequestPlan:
    """Plan the ``index``-th request of a routing key, drawing from its own ``rng``."""
    entry = script[index % len(script)] if script else ScriptEntry()
    # Drawn even when unused, so later draws do not depend on the request's shape.
    natural = model.sample_output_tokens(rng)
    if entry.status is not None:
        return RequestPlan(entry, 0, "error", (), None, f"{rng.getrandbits(96):024x}")
    if entry.tokens is not None:
        natural = entry.tokens
    elif entry.content is not None:
        natural = len(entry.content.split())
    count = natural if max_tokens is None else min(natural, max_tokens)
    latency = model.sample(prompt_tokens, count, rng)
    # Scripted text keeps its own whitespace; filler words (from the rng) pad it to ``count``.
    pieces: list[str] = re.findall(r"\s*\S+", entry.content or "")[:count]
    while len(pieces) < count:
        word = _FILLER[rng.randrange(len(_FILLER))]
        pieces.append(f" {word}" if pieces else word)
    finish = "length" if count < natural else "stop"
    return RequestPlan(entry, count, finish, tuple(pieces), latency, f"{rng.getrandbits(96):024x}")


def request_rng(seed: int, key: str, index: int) -> random.Random:
    """The RNG of the ``index``-th request (from 0) of routing key ``key``.

    Seeded with an integer from sha256, whose value does not depend on the
    process (unlike ``hash()``, which is salted per process for str).
    """
    digest = hashlib.sha256(f"{seed}\x00{key}\x00{index}".encode()).digest()
    return random.Random(int.from_bytes(digest, "big"))  # noqa: S311 (simulation, not security)


def load_latency(path: str | Path) -> LatencyModel:
    """A LatencyModel from a TOML file of its fields (at top level)."""
    with open(path, "rb") as f:
        return LatencyModel.model_validate(tomllib.load(f))


def routing_key(user: str | None, sandbox: str | None, prefix: str) -> str:
    """Whose request this is: the ``user`` field, else the sandbox header, else the path prefix."""
    if user:
        return user
    if sandbox:
        return sandbox
    prefix = prefix.strip("/")
    parts = prefix.split("/")
    # The proxy's /sandboxes/{id} names the same sandbox as the header: one key, one latency stream.
    if len(parts) == 2 and parts[0] == "sandboxes" and parts[1]:
        return parts[1]
    return prefix or "default"
