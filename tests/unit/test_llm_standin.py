"""The stand-in LLM server (crabd.llm): OpenAI wire format over real sockets, pacing, scripts, determinism."""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError

from crabd.llm import (
    LatencyModel,
    ScriptedToolCall,
    ScriptEntry,
    ScriptError,
    StandinServer,
    load_script,
    plan_request,
    request_rng,
    routing_key,
)
from crabd.llm.standin import token_id

# No randomness in the pacing: 0.2 s to the first token, then 0.02 s per token.
STEADY = LatencyModel(
    prefill_base_s=0.2,
    prefill_per_token_s=0.0,
    decode_per_token_s=0.02,
    decode_jitter_sigma=0.0,
    tail_sigma=0.0,
    stall_probability=0.0,
)


def post(url: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=hdrs, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "crab-standin-small", "messages": [{"role": "user", "content": text}], **extra}


def test_models_list_under_any_prefix() -> None:
    with StandinServer(model="tiny") as srv:
        for path in ("/v1/models", "/sandboxes/abc/v1/models"):
            with urllib.request.urlopen(srv.url + path, timeout=5) as resp:
                body = json.loads(resp.read())
            assert body["object"] == "list"
            assert [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == [("tiny", "model", "crab-standin")]
            assert isinstance(body["data"][0]["created"], int)
        assert srv.requests == {"models": 2}


def test_chat_and_completions_non_streaming() -> None:
    with StandinServer(time_scale=0.01) as srv:
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "fix the bug"}]},
        ]
        status, body = post(f"{srv.url}/v1/chat/completions", {"messages": messages, "max_tokens": 5})
        assert status == 200
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["model"] == "crab-standin-small"
        (choice,) = body["choices"]
        assert choice["message"]["role"] == "assistant"
        assert len(choice["message"]["content"].split()) == 5
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}

        status, body = post(f"{srv.url}/sandboxes/s1/v1/completions", {"prompt": "a b c d", "max_tokens": 7})
        assert status == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert len(body["choices"][0]["text"].split()) == 7
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}

        # No max_tokens: the length comes from the model's distribution, and is what was planned.
        status, body = post(f"{srv.url}/v1/completions", {"prompt": ["one two", "three"]})
        served = srv.served[-1]
        assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
        assert 8 <= body["usage"]["completion_tokens"] == served.plan.output_tokens <= 1024
        assert body["choices"][0]["text"] == served.plan.text and served.prompt_tokens == 3
        assert srv.requests == {"chat": 1, "completions": 2}


def test_non_streaming_answers_after_the_full_time() -> None:
    with StandinServer(latency=STEADY) as srv:
        start = time.monotonic()
        status, _ = post(f"{srv.url}/v1/chat/completions", chat("hi", max_tokens=6))
        elapsed = time.monotonic() - start
    assert status == 200
    assert 0.3 <= elapsed < 1.0  # 0.2 s + 5 x 0.02 s


async def _stream(url: str, body: dict[str, Any]) -> tuple[list[float], list[bytes], str]:
    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        async with session.post(url, json=body) as resp:
            assert resp.status == 200
            arrivals, events = [], []
            async for line in resp.content:
                if line.startswith(b"data: "):
                    arrivals.append(time.monotonic() - start)
                    events.append(line[len(b"data: ") :].strip())
            return arrivals, events, resp.headers["Content-Type"]


def test_chat_streaming_arrives_over_time() -> None:
    async def scenario() -> tuple[list[float], list[bytes], str, str]:
        async with StandinServer(latency=STEADY) as srv:
            body = chat("hello there", stream=True, max_tokens=11, stream_options={"include_usage": True})
            arrivals, events, ctype = await _stream(f"{srv.url}/v1/chat/completions", body)
            return arrivals, events, ctype, srv.served[0].plan.text

    arrivals, events, ctype, planned = asyncio.run(scenario())
    assert ctype.startswith("text/event-stream")
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    tokens, finish, usage = chunks[:11], chunks[11], chunks[12]
    assert tokens[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in tokens) == planned
    assert len(planned.split()) == 11
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["delta"] == {}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 11
    # First token after ~0.2 s, the 11th ~0.2 s later: the client really sees them arrive over time.
    assert 0.18 <= arrivals[0] < 0.5
    assert arrivals[10] - arrivals[0] >= 0.17
    # Paced token by token (0.02 s apart), not sent in bursts.
    assert sum(b - a >= 0.01 for a, b in itertools.pairwise(arrivals[:11])) >= 8


def test_completions_streaming_format() -> None:
    async def scenario() -> list[bytes]:
        async with StandinServer(time_scale=0.01) as srv:
            _, events, _ = await _stream(f"{srv.url}/v1/completions", {"prompt": "x", "stream": True, "max_tokens": 3})
            return events

    events = asyncio.run(scenario())
    assert events[-1] == b"[DONE]" and len(events) == 5  # 3 tokens, the finish chunk, [DONE]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len("".join(c["choices"][0]["text"] for c in chunks).split()) == 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_logprobs_streamed_per_token_and_in_the_completions_shape() -> None:
    script = [ScriptEntry(content="alpha beta gamma")]

    async def scenario() -> tuple[list[bytes], tuple[int, Any], tuple[int, Any]]:
        async with StandinServer(time_scale=0.01, script=script) as srv:
            ask = chat("go", stream=True, logprobs=True, seed=3, return_tokens_as_token_ids=True)
            _, events, _ = await _stream(f"{srv.url}/v1/chat/completions", ask)
            whole = await asyncio.to_thread(post, f"{srv.url}/v1/chat/completions", chat("go", logprobs=True, seed=3))
            legacy = {"model": "crab-standin-small", "prompt": "go", "logprobs": 0, "seed": 3}
            completions = await asyncio.to_thread(post, f"{srv.url}/v1/completions", legacy)
            return events, whole, completions

    events, (_, whole), (_, completions) = asyncio.run(scenario())
    streamed = [
        e["logprobs"]["content"] for e in (json.loads(x)["choices"][0] for x in events[:-1]) if e.get("logprobs")
    ]
    assert [len(c) for c in streamed] == [1, 1, 1]  # one entry per token chunk
    assert [c[0]["token"] for c in streamed] == [f"token_id:{token_id(p)}" for p in ("alpha", " beta", " gamma")]
    # The same seeded answer carries the same values whether streamed or not.
    plain = whole["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in plain] == ["alpha", " beta", " gamma"]
    assert [c[0]["logprob"] for c in streamed] == [c["logprob"] for c in plain]
    lp = completions["choices"][0]["logprobs"]
    assert lp["tokens"] == ["alpha", " beta", " gamma"] and len(lp["token_logprobs"]) == 3


def test_scripted_tool_calls_streamed_and_not() -> None:
    call = ScriptedToolCall(name="bash", arguments={"command": "make -j2"})
    script = [ScriptEntry(content="build it", tool_calls=(call,))]

    async def scenario() -> tuple[list[bytes], tuple[int, Any]]:
        async with StandinServer(time_scale=0.01, script=script) as srv:
            _, events, _ = await _stream(f"{srv.url}/v1/chat/completions", chat("go", stream=True))
            whole = await asyncio.to_thread(post, f"{srv.url}/v1/chat/completions", chat("go"))
            return events, whole

    events, (status, body) = asyncio.run(scenario())
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    [streamed] = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert streamed["index"] == 0 and streamed["function"]["name"] == "bash"
    assert json.loads(streamed["function"]["arguments"]) == {"command": "make -j2"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == "build it"
    assert status == 200
    msg = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] == "build it"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"command": "make -j2"}
    assert msg["tool_calls"][0]["id"].startswith("call_")
    with pytest.raises(ValueError, match="tool_calls"):
        ScriptEntry(status=500, tool_calls=(call,))


def _texts(srv: StandinServer, order: list[str]) -> dict[str, list[str]]:
    """Send one chat request per key in ``order``; return each key's answers in order."""
    out: dict[str, list[str]] = {}
    for key in order:
        if key.startswith("user:"):
            _, body = post(f"{srv.url}/v1/chat/completions", chat("q", user=key[5:]))
        elif key.startswith("hdr:"):
            _, body = post(f"{srv.url}/v1/chat/completions", chat("q"), {"X-Crab-Sandbox": key[4:]})
        else:
            _, body = post(f"{srv.url}/sandboxes/{key}/v1/chat/completions", chat("q"))
        out.setdefault(key, []).append(body["choices"][0]["message"]["content"])
    return out


def test_same_seed_same_answers_and_latency_whatever_the_interleaving() -> None:
    keys = ["user:a", "hdr:b", "c"]
    with StandinServer(seed=42, time_scale=0) as one, StandinServer(seed=42, time_scale=0) as two:
        first = _texts(one, keys * 3)
        second = _texts(two, sorted(keys * 3))  # same per-key order, different interleaving
        assert first == second
        lat_one = {(s.key, s.index): s.plan.latency for s in one.served}
        lat_two = {(s.key, s.index): s.plan.latency for s in two.served}
        assert lat_one == lat_two and len(lat_one) == 9
    assert {s.key for s in one.served} == {"a", "b", "c"}
    # Different keys and successive requests of one key differ.
    assert len({t for texts in first.values() for t in texts}) == 9
    with StandinServer(seed=43, time_scale=0) as other:
        assert _texts(other, keys) != {k: v[:1] for k, v in first.items()}


def test_routing_key_precedence() -> None:
    assert routing_key("u", "sb", "sandboxes/x/") == "u"
    assert routing_key(None, "sb", "sandboxes/x/") == "sb"
    assert routing_key(None, None, "sandboxes/x/") == "x"  # the proxy's path and the header agree
    assert routing_key(None, None, "team/7/") == "team/7"
    assert routing_key(None, None, "") == "default"


def test_scripted_errors_content_and_cycling(tmp_path: Path) -> None:
    script = tmp_path / "script.jsonl"
    lines = [
        {"status": 429, "error": "slow down", "error_type": "rate_limit_error"},
        {"content": "hello  world\nbye"},
        {},
        {"status": 503},
    ]
    script.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    with StandinServer(time_scale=0, script=script) as srv:
        url = f"{srv.url}/v1/chat/completions"
        assert post(url, chat("q")) == (
            429,
            {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": 429}},
        )
        status, body = post(url, chat("q"))
        assert status == 200 and body["choices"][0]["message"]["content"] == "hello  world\nbye"
        assert body["usage"]["completion_tokens"] == 3
        assert post(url, chat("q"))[0] == 200
        status, body = post(url, chat("q"))
        assert status == 503 and body["error"]["type"] == "InternalServerError" and body["error"]["code"] == 503
        assert post(url, chat("q"))[0] == 429  # cycles
        # Another key starts at the top of the script.
        assert post(url, chat("q", user="other"))[0] == 429


def test_script_tokens_truncate_and_pad() -> None:
    entries = [ScriptEntry(content="one two three four", tokens=2), ScriptEntry(content="one", tokens=4)]
    model = LatencyModel(time_scale=0)
    short = plan_request(model, entries, request_rng(0, "k", 0), 0, 1, None)
    long = plan_request(model, entries, request_rng(0, "k", 1), 1, 1, None)
    capped = plan_request(model, entries, request_rng(0, "k", 1), 1, 1, 3)
    assert (short.text, short.output_tokens, short.finish_reason) == ("one two", 2, "stop")
    assert long.text.startswith("one ") and len(long.text.split()) == 4
    assert (capped.output_tokens, capped.finish_reason) == (3, "length")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"content": "a"}\n{not json\n', ":2: not valid JSON"),
        ('{"content": "a"}\n\n[1]\n', ":3: expected a JSON object, got list"),
        ('{"contents": "a"}\n', ":1: contents: Extra inputs are not permitted"),
        ('{"status": 200}\n', ":1: status: Input should be greater than or equal to 400"),
        ('{"error": "x"}\n', ":1: entry: Value error, 'error' and 'error_type' need a 'status'"),
        ('{"status": 500, "content": "x"}\n', ":1: entry: Value error, an error entry"),
        ("\n\n", ": the script has no entries"),
    ],
)
def test_script_validation_names_the_line(tmp_path: Path, text: str, message: str) -> None:
    script = tmp_path / "s.jsonl"
    script.write_text(text)
    with pytest.raises(ScriptError) as info:
        load_script(script)
    assert str(info.value).startswith(str(script)) and message in str(info.value)


def test_disconnect_mid_stream_and_before_a_json_answer() -> None:
    async def scenario(url: str) -> tuple[list[bytes], BaseException | None]:
        events: list[bytes] = []
        try:
            async with aiohttp.ClientSession() as session, session.post(url, json=chat("q", stream=True)) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        events.append(line.strip())
        except aiohttp.ClientError as e:
            return events, e
        return events, None

    with StandinServer(time_scale=0.01, script=[ScriptEntry(tokens=10, disconnect=True)]) as srv:
        url = f"{srv.url}/v1/chat/completions"
        events, error = asyncio.run(scenario(url))
        assert isinstance(error, aiohttp.ClientPayloadError)
        assert len(events) == 5 and b"[DONE]" not in events
        with pytest.raises(http.client.RemoteDisconnected):
            post(url, chat("q"))


def test_delay_outlasts_a_client_timeout_and_close_is_prompt() -> None:
    srv = StandinServer(time_scale=0, script=[ScriptEntry(delay_s=5.0)])
    srv.start()
    try:
        req = urllib.request.Request(f"{srv.url}/v1/chat/completions", data=json.dumps(chat("q")).encode())
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            urllib.request.urlopen(req, timeout=0.3)
        assert time.monotonic() - start < 1.0
    finally:
        start = time.monotonic()
        srv.close()
    assert time.monotonic() - start < 2.0


def test_bad_requests() -> None:
    with StandinServer(time_scale=0) as srv:
        chat_url, cmpl_url = f"{srv.url}/v1/chat/completions", f"{srv.url}/v1/completions"
        cases: list[tuple[str, dict[str, Any] | bytes]] = [
            (chat_url, b"{"),
            (chat_url, b"[1, 2]"),
            (chat_url, {"messages": []}),
            (chat_url, {"prompt": "x"}),
            (cmpl_url, {"messages": [{"role": "user", "content": "x"}]}),
            (cmpl_url, {"prompt": "x", "max_tokens": 0}),
            (chat_url, chat("x", stream="yes")),
        ]
        for url, body in cases:
            status, error = post(url, body)
            assert status == 400, body
            assert error["error"]["type"] == "BadRequestError" and error["error"]["code"] == 400
        status, error = post(chat_url, {**chat("x"), "model": "gpt-9"})
        assert status == 404
        assert error["error"]["message"] == "The model `gpt-9` does not exist."
        assert srv.requests == {"chat": 6, "completions": 2} and srv.served == []


def test_latency_statistics() -> None:
    model = LatencyModel()
    samples = [model.sample(200, 100, request_rng(7, "stats", i)) for i in range(4000)]
    ttft = statistics.median(s.ttft_s for s in samples)
    assert 0.027 < ttft < 0.034  # 0.02 + 200 x 0.00005, times a median-1 factor
    gap = statistics.median(s.decode_s / 99 for s in samples)
    assert 0.0054 < gap < 0.0066
    stalled = sum(s.stalled for s in samples) / len(samples)
    assert 0.01 < stalled < 0.03
    totals = sorted(s.total_s for s in samples)
    p50, p99 = totals[len(totals) // 2], totals[int(len(totals) * 0.99)]
    assert p99 / p50 > 2.0  # lognormal tail plus stalls
    stalled_median = statistics.median(s.total_s for s in samples if s.stalled)
    assert stalled_median > 2.0 * p50
    # Outside stalls the spread is the call's lognormal factor: p90/p10 = exp(2 x 1.28 x 0.25) ~ 1.9.
    calm = sorted(s.total_s for s in samples if not s.stalled)
    assert 1.7 < calm[int(len(calm) * 0.9)] / calm[int(len(calm) * 0.1)] < 2.1

    lengths = [model.sample_output_tokens(request_rng(7, "len", i)) for i in range(4000)]
    assert 135 <= statistics.median(lengths) <= 165
    assert min(lengths) >= 8 and max(lengths) <= 1024
    long = LatencyModel(output_tokens_median=5000)
    assert max(long.sample_output_tokens(request_rng(0, "x", i)) for i in range(100)) == 1024

    # time_scale multiplies every wait and changes nothing else.
    fast = LatencyModel(time_scale=0.01).sample(200, 50, request_rng(1, "k", 0))
    real = model.sample(200, 50, request_rng(1, "k", 0))
    assert fast.stalled == real.stalled and len(fast.gaps_s) == 49
    assert fast.total_s == pytest.approx(real.total_s * 0.01)


def test_latency_model_is_validated_and_frozen() -> None:
    with pytest.raises(ValidationError):
        LatencyModel(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        LatencyModel(stall_probability=1.5)
    with pytest.raises(ValidationError):
        LatencyModel(output_tokens_min=10, output_tokens_max=5)
    model = LatencyModel()
    with pytest.raises(ValidationError):
        model.time_scale = 2.0  # type: ignore[misc]


def test_start_close_leave_nothing_behind() -> None:
    threads = threading.active_count()
    srv = StandinServer()
    with srv:
        port = srv.port
        with pytest.raises(RuntimeError):
            srv.start()
    assert threading.active_count() == threads
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass

    async def in_loop() -> int:
        async with StandinServer() as aio:
            with pytest.raises(RuntimeError):
                aio.close()  # it belongs to this loop
            return aio.port

    port = asyncio.run(in_loop())
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    with pytest.raises(ValueError, match="non-loopback"):
        StandinServer(host="0.0.0.0")
    StandinServer(host="0.0.0.0", allow_remote=True)  # allowed, never started


def test_cli_serves_until_sigterm() -> None:
    cmd = [sys.executable, "-c", "import sys; from crabd.llm.standin import main; sys.exit(main())"]
    proc = subprocess.Popen([*cmd, "--port", "0", "--model", "cli-model"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # other loggers (asyncio debug mode) may speak first
            seen.append(line)
            if match := re.search(r"(http://127\.0\.0\.1:\d+)/v1", line):
                break
        assert match, seen
        with urllib.request.urlopen(match.group(1) + "/v1/models", timeout=5) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == "cli-model"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
