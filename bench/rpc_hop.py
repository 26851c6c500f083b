"""Benchmark: what one gRPC hop between two of crabd's processes would cost (issue 34, item 4's design).

    .venv/bin/python -m bench.rpc_hop --out bench-results/rpc_hop.json

A crabd of several processes needs a way for a request to reach the process
that owns its sandbox.  If a front process forwarded every call to a worker
over gRPC, each call would cost the front a server side (receiving the
caller's call) plus a client side (making the worker's), and the worker a
server side again.  This measures those two sides for the cheapest call
crab's API has (``DaemonStatus`` answered by a stub servicer, no crabd work
at all), between two processes over a unix socket, with the grpc.aio
client and server crabd itself uses: CPU per call of each process (from
/proc, so the library's own threads count), and wall time per call.
Several repetitions; medians.  Compare with a whole plain command's cost
to crabd (``bench.op_cost``: about 2 ms on this host kind).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from bench.results import write_json
from crabd.api.v1 import crab_pb2 as pb
from crabd.api.v1 import crab_pb2_grpc as pb_grpc

WARM_UP = 200


class _Stub(pb_grpc.CrabServicer):
    async def DaemonStatus(
        self, request: pb.DaemonStatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DaemonStatusResponse:
        return pb.DaemonStatusResponse()


def _serve(sock: str, ready: Event, done: Event) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_CrabServicer_to_server(_Stub(), server)
        server.add_insecure_port(f"unix:{sock}")
        await server.start()
        ready.set()
        while not done.is_set():
            await asyncio.sleep(0.05)
        await server.stop(0)

    asyncio.run(main())


def _cpu_s(pid: int) -> float:
    """The process's user+system CPU (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _calls(sock: str, n: int) -> float:
    """Make ``n`` calls one after another; the wall seconds they took."""

    async def main() -> float:
        async with grpc.aio.insecure_channel(f"unix:{sock}") as channel:
            stub = pb_grpc.CrabStub(channel)
            for _ in range(WARM_UP):
                await stub.DaemonStatus(pb.DaemonStatusRequest())
            t0 = time.perf_counter()
            for _ in range(n):
                await stub.DaemonStatus(pb.DaemonStatusRequest())
            return time.perf_counter() - t0

    return asyncio.run(main())


def measure(calls: int, reps: int) -> dict[str, Any]:
    """Per repetition: server CPU, client CPU and wall time per call (ms); and their medians."""
    with tempfile.TemporaryDirectory(prefix="crab-rpc-hop-") as tmp:
        sock = str(Path(tmp) / "hop.sock")
        ctx = mp.get_context("spawn")
        ready, done = ctx.Event(), ctx.Event()
        server = ctx.Process(target=_serve, args=(sock, ready, done))
        server.start()
        try:
            if not ready.wait(30):
                raise RuntimeError("the stub gRPC server did not start")
            rows = []
            assert server.pid is not None
            for _ in range(reps):
                s0, c0 = _cpu_s(server.pid), _cpu_s(os.getpid())
                wall = _calls(sock, calls)
                s1, c1 = _cpu_s(server.pid), _cpu_s(os.getpid())
                rows.append(
                    {
                        "server_cpu_ms": (s1 - s0) / calls * 1e3,
                        "client_cpu_ms": (c1 - c0) / calls * 1e3,
                        "wall_ms": wall / calls * 1e3,
                    }
                )
        finally:
            done.set()
            server.join(10)
            if server.is_alive():
                server.kill()
    medians = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    return {"calls_per_rep": calls, "reps": rows, "median": medians}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5000, help="calls per repetition")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench-results/rpc_hop.json")
    args = ap.parse_args()
    results = measure(args.calls, args.reps)
    m = results["median"]
    print("| per call (median) | server CPU | client CPU | wall |")
    print("|---|---|---|---|")
    print(f"| DaemonStatus, stub servicer | {m['server_cpu_ms']} ms | {m['client_cpu_ms']} ms | {m['wall_ms']} ms |")
    print(f"results: {write_json(results, args.out)}")


if __name__ == "__main__":
    main()
