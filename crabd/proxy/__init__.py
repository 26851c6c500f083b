"""crab's OpenAI-compatible reverse proxy: an agent's LLM request ends its sandbox's turn.

See docs/proxy.md.  ``server.OpenAIProxy`` is the HTTP server,
``gate.TurnGate`` what it needs from crabd, ``peer`` who is calling.
"""

from __future__ import annotations

from crabd.proxy.gate import HeldTurn, ProxyMetrics, TurnGate
from crabd.proxy.server import SANDBOX_HEADER, OpenAIProxy
from crabd.util.loopback_peer import identify_peer

__all__ = ["SANDBOX_HEADER", "HeldTurn", "OpenAIProxy", "ProxyMetrics", "TurnGate", "identify_peer"]
