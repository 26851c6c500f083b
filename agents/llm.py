"""A small synchronous client for OpenAI-compatible servers (vLLM, crab's proxy, the stand-in).

Only what the agents here need: ``/v1/models`` and ``/v1/chat/completions``
(non-streaming), with tools, seeds and logprobs; :class:`ChatClient` blocks,
:class:`AsyncChatClient` is its asyncio twin.  Network and HTTP failures
become :class:`LLMError` with the status and the server's message.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp


class LLMError(Exception):
    """The server could not be reached, or answered with an error (``status`` 0: no answer)."""

    def __init__(self, message: str, *, status: int = 0, url: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.url = url


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the server sent it

    def args(self) -> dict[str, Any]:
        try:
            value = json.loads(self.arguments or "{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Completion:
    content: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    #: Per generated token, when the server returned logprobs: (token text, logprob).
    logprobs: tuple[tuple[str, float], ...] = ()
    #: Generated token ids, when the server returned them (vLLM with ``return_tokens_as_token_ids``).
    token_ids: tuple[int, ...] = ()
    held_s: float = 0.0  # how long crab's proxy held the answer back (its X-Crab-Held-Seconds header)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return msg


def _token_id(text: str) -> int | None:
    # vLLM's return_tokens_as_token_ids spells each token "token_id:<n>".
    return int(text[9:]) if text.startswith("token_id:") and text[9:].isdigit() else None


class ChatClient:
    """``ChatClient("http://127.0.0.1:8000/v1")``; ``model=""`` picks the server's first model."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "",
        api_key: str = "",
        timeout_s: float = 600.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self._model = model

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], Any]:
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)  # noqa: S310 (http(s) URL from the caller)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        for k, v in self.headers.items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310
                return json.loads(resp.read()), resp.headers
        except urllib.error.HTTPError as exc:
            raise http_error(method, url, exc.code, exc.read().decode("utf-8", "replace")) from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise LLMError(f"{method} {url}: {exc}", url=url) from exc

    @property
    def model(self) -> str:
        if not self._model:
            self._model = first_model(self.base_url, self.models())
        return self._model

    def models(self) -> list[str]:
        body, _ = self._request("GET", "/models")
        return model_ids(body)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        user: str | None = None,
        logprobs: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> Completion:
        body = chat_body(self.model, messages, tools, max_tokens, temperature, seed, user, logprobs, extra)
        t0 = time.monotonic()
        data, headers = self._request("POST", "/chat/completions", body)
        return parse_completion(self.base_url, data, headers, time.monotonic() - t0)


def http_error(method: str, url: str, status: int, text: str) -> LLMError:
    """An HTTP error answer as LLMError, with the server's own message when it sent the OpenAI error shape."""
    detail = text[:500]
    with contextlib.suppress(ValueError, KeyError, TypeError):
        detail = json.loads(text)["error"]["message"]
    return LLMError(f"{method} {url}: HTTP {status}: {detail}", status=status, url=url)


def model_ids(body: Any) -> list[str]:
    """The model ids of a ``/v1/models`` answer."""
    return [str(m["id"]) for m in body.get("data", [])]


def first_model(base_url: str, models: list[str]) -> str:
    if not models:
        raise LLMError(f"{base_url}/models lists no model")
    return models[0]


def chat_body(
    model: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    max_tokens: int | None,
    temperature: float | None,
    seed: int | None,
    user: str | None,
    logprobs: bool,
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The JSON body of a ``/chat/completions`` request."""
    body: dict[str, Any] = {"model": model, "messages": list(messages)}
    for key, value in (
        ("tools", list(tools) if tools else None),
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("seed", seed),
        ("user", user),
    ):
        if value is not None:
            body[key] = value
    if logprobs:
        body["logprobs"] = True
    body.update(extra or {})
    return body


def parse_completion(base_url: str, data: Any, headers: Mapping[str, str] | None, seconds: float) -> Completion:
    """A non-streamed chat completion's JSON, as a :class:`Completion`; LLMError if it is malformed."""
    try:
        choice = data["choices"][0]
        msg = choice.get("message") or {}
        calls = tuple(
            ToolCall(str(c.get("id", "")), str(c["function"]["name"]), str(c["function"].get("arguments", "")))
            for c in msg.get("tool_calls") or ()
        )
        lp = tuple(
            (str(t.get("token", "")), float(t.get("logprob", 0.0)))
            for t in ((choice.get("logprobs") or {}).get("content") or ())
        )
        ids = tuple(i for i in (_token_id(t) for t, _ in lp) if i is not None)
        usage = data.get("usage") or {}
        held = headers.get("X-Crab-Held-Seconds") if headers is not None else None
        return Completion(
            content=str(msg.get("content") or ""),
            tool_calls=calls,
            finish_reason=str(choice.get("finish_reason") or ""),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            seconds=seconds,
            logprobs=lp,
            token_ids=ids if len(ids) == len(lp) else (),
            held_s=float(held) if held else 0.0,
            raw=data,
        )
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise LLMError(f"{base_url}: malformed completion: {str(data)[:300]}") from exc


class AsyncChatClient:
    """The asyncio twin of :class:`ChatClient` (aiohttp), for many concurrent rollouts.

    ``async with AsyncChatClient(url) as llm: await llm.chat(messages)``; one
    connection pool, closed by :meth:`aclose`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "",
        api_key: str = "",
        timeout_s: float = 600.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._model = model
        self._session: aiohttp.ClientSession | None = None

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        return self._session

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> AsyncChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
        url = self.base_url + path
        http = await self._http()
        try:
            async with http.request(method, url, json=body) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise http_error(method, url, resp.status, text)
                return json.loads(text), resp.headers
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            raise LLMError(f"{method} {url}: {exc or type(exc).__name__}", url=url) from exc

    async def model(self) -> str:
        if not self._model:
            body, _ = await self._request("GET", "/models")
            self._model = first_model(self.base_url, model_ids(body))
        return self._model

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        user: str | None = None,
        logprobs: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> Completion:
        model = await self.model()
        body = chat_body(model, messages, tools, max_tokens, temperature, seed, user, logprobs, extra)
        t0 = time.monotonic()
        data, headers = await self._request("POST", "/chat/completions", body)
        return parse_completion(self.base_url, data, headers, time.monotonic() - t0)
