"""The proxy's view of crabd: who may end which sandbox's turn, and holding an LLM response.

``crabd/proxy`` (the OpenAI-compatible reverse proxy) only knows the small
``TurnGate`` interface; this module implements it on top of the service, so
the proxy obeys the same rule as the gRPC socket: a caller (identified by
the kernel, see ``util/loopback_peer.py``) acts only on its own sandboxes, root on
all.
"""

from __future__ import annotations

import asyncio
import logging
import time

from crabd.errors import CrabError
from crabd.models import Caller
from crabd.service.service import Service

log = logging.getLogger("crabd.proxy")


class HeldResponse:
    """One LLM request's turn end, running while the request is upstream."""

    def __init__(self, service: Service, sandbox_id: str) -> None:
        self._service = service
        self._sandbox_id = sandbox_id
        self._started = time.monotonic()
        self._task = asyncio.create_task(self._end(), name=f"crab-turn-end-{sandbox_id}")

    async def _end(self) -> None:
        rec = await self._service.sandboxes.get(self._sandbox_id)
        if rec is None:
            return
        await self._service.flow.end_turn(rec, if_open=True)

    async def release(self) -> float:
        """Wait until the turn's checkpoint is durable or skipped; the seconds this response was held."""
        ready = time.monotonic()
        flow = self._service.flow
        flow.observe_llm(self._sandbox_id, ready - self._started)
        # The turn end itself (session capture, decision) usually finished long
        # ago, while the LLM generated; if not, the agent waits for it too.
        try:
            await asyncio.shield(self._task)
        except CrabError as exc:
            # The answer is still the agent's: it learns about its sandbox
            # (dead, busy) from its next action there, with the real error.
            log.warning("turn end at an LLM request failed", extra={"sandbox": self._sandbox_id, "error": exc.message})
        await flow.settle(self._sandbox_id)
        return time.monotonic() - ready

    def abandon(self) -> None:
        # The client went away.  The turn end and its checkpoint go on: the
        # sandbox's state is what it is whether or not anyone reads the answer.
        def done(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                log.warning("turn end of an abandoned LLM request failed", extra={"error": str(exc)})

        self._task.add_done_callback(done)


class ServiceGate:
    """``crabd.proxy.gate.TurnGate`` over the service."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def authorize(self, caller: Caller, sandbox_ref: str) -> str:
        return self.service.authorize(caller, sandbox_ref)

    def end_turn(self, sandbox_id: str) -> HeldResponse:
        return HeldResponse(self.service, sandbox_id)
