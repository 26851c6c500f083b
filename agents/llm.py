"""A small synchronous client for OpenAI-compatible servers (vLLM, crab's proxy, the stand-in).

Only what the agents here need: ``/v1/models`` and ``/v1/chat/completions``
(non-streaming), with tools, seeds and logprobs.  Network and HTTP failures
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
            detail = exc.read().decode("utf-8", "replace")[:500]
            with contextlib.suppress(ValueError, KeyError, TypeError):
                detail = json.loads(detail)["error"]["message"]
            raise LLMError(f"{method} {url}: HTTP {exc.code}: {detail}", status=exc.code, url=url) from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise LLMError(f"{method} {url}: {exc}", url=url) from exc

    @property
    def model(self) -> str:
        if not self._model:
            models = self.models()
            if not models:
                raise LLMError(f"{self.base_url}/models lists no model")
            self._model = models[0]
        return self._model

    def models(self) -> list[str]:
        body, _ = self._request("GET", "/models")
        return [str(m["id"]) for m in body.get("data", [])]

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
        body: dict[str, Any] = {"model": self.model, "messages": list(messages)}
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
        t0 = time.monotonic()
        data, headers = self._request("POST", "/chat/completions", body)
        seconds = time.monotonic() - t0
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
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LLMError(f"{self.base_url}: malformed completion: {str(data)[:300]}") from exc
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
