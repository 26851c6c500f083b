"""Benchmark: process restore through crab's own runc layer, straight from an image directory (issue 19).

    .venv/bin/python bench/runc_restore.py --out bench-results/runc_restore.json

One networked bookworm sandbox (crab-init as PID 1, a Python counter server,
and a Python process holding ``--mb`` MB) is checkpointed with
``runc checkpoint --leave-running`` into a plain image directory; then N forks
(N = 1, 4, 8) are restored IN PARALLEL from that one directory, each into its
own copy of the upper dir, bundle, netns and CNI address.  Reported, as
medians of ``--reps``: dump time; per fork the time of each launch step
(netns, CNI ADD, bundle, overlay mount, ``runc restore``; and ``criu_own``,
CRIU's own time inside ``runc restore`` from its log's timestamps, i.e. the
bare CRIU restore of the same images) and the wall time until all N forks
run; every fork's counter is checked to continue from the dumped value.
Root, Docker (for the image) and CRIU are needed; everything made is
removed afterwards.  Compare: Docker's path restores a fork in
0.75 s and 8 forks in 14.5-15.6 s on this host kind (PLATFORM.md, bench/processes.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from crabd.backends.runc import bundle, cleanup, cni, launch, named_netns, rootfs
from crabd.backends.runc.cli import Runc, criu_own_seconds
from crabd.config import NetworkConfig
from crabd.host import images
from crabd.runtime import initbin
from crabd.runtime.initproto import InitConnection, SpawnSpec
from crabd.util.netns import Netns

SERVER = r"""
import os, socket
data = bytearray(os.urandom({mb} << 20))
n = 0
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 8000)); s.listen()
while True:
    c, _ = s.accept(); n += 1; c.sendall(str(n).encode()); c.close()
"""


def ask(ip: object, tries: int = 600) -> str:
    for _ in range(tries):
        try:
            with socket.create_connection((str(ip), 8000), timeout=2) as s:
                return s.recv(100).decode()
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{ip}:8000 does not answer")


def criu_seconds(log: Path) -> float:
    """CRIU's own time for a restore (its log's last timestamp); NaN if none."""
    own = criu_own_seconds(log)
    return float("nan") if own is None else own


async def _spawn(ns: Netns, code: str) -> None:
    async with await InitConnection.open(netns=ns) as conn:
        await conn.hello()
        await conn.spawn(
            SpawnSpec(argv=["python3", "-c", code], env={"PATH": "/usr/bin:/bin"}, persistent=True, name="srv")
        )


class Bench:
    def __init__(self, base: Path) -> None:
        self.base = base
        net = NetworkConfig(name=f"crb{os.getpid() % 100000}")
        settings = cni.CniSettings(net=net, subnet=f"10.215.{os.getpid() % 250}.0/24", cache_dir=base / "cni")
        self.layout = cleanup.Layout(base / "runc", base / "bundles", base / "netns", base / "rootfs", settings)
        self.runc = Runc(self.layout.runc_root, log_dir=base / "criu-logs")
        self.network = cni.CniNetwork(settings)
        self.launcher = launch.Launcher(self.layout, self.runc, self.network)
        self.lower = rootfs.lower_dir(images.find_recipe("bookworm").image_ref)
        self.init = initbin.install(base / "state")
        self.made: list[str] = []

    def launch(self, cid: str, upper_from: Path | None = None, images_dir: Path | None = None) -> launch.Launched:
        self.made.append(cid)
        upper = self.base / "sv" / cid / "upper"
        if upper_from is not None:  # stands in for a btrfs snapshot
            upper.parent.mkdir(parents=True)
            subprocess.run(["cp", "-a", str(upper_from), str(upper)], check=True, timeout=300)
        spec = bundle.ContainerSpec(id=cid, netns=Path("-"), init_binary=self.init, networked=True)
        restore = None if images_dir is None else launch.Restore(images_dir, self.base / "work" / cid)
        return self.launcher.launch(spec, launch.Storage((self.lower,), upper, upper.parent / "work"), restore)

    def close(self) -> None:
        for cid in self.made:
            self.launcher.remove(cid)
        self.network.teardown()
        named_netns.release_dir(self.layout.netns)
        shutil.rmtree(self.base, ignore_errors=True)


def run(b: Bench, mb: int, reps: int, forks: list[int]) -> dict[str, Any]:
    orig = b.launch("bench-orig")
    asyncio.run(_spawn(Netns(orig.state.pid, "bench-orig"), SERVER.format(mb=mb)))
    assert ask(orig.ip) == "1"
    upper = b.base / "sv" / "bench-orig" / "upper"
    out: dict[str, Any] = {"mb": mb, "reps": reps, "dump_s": [], "forks": {}}
    for rep in range(reps):
        images_dir = b.base / "images" / str(rep)
        t = time.monotonic()
        b.runc.checkpoint("bench-orig", images_dir, b.base / "work" / f"dump-{rep}")
        out["dump_s"].append(time.monotonic() - t)
        out["image_bytes"] = sum(p.stat().st_size for p in images_dir.iterdir())
        dumped = int(ask(orig.ip))  # the value after the dump; the forks continue from dumped
        for n in forks:
            ids = [f"bench-r{rep}-n{n}-{i}" for i in range(n)]
            t = time.monotonic()
            with ThreadPoolExecutor(n) as pool:
                done = list(pool.map(b.launch, ids, [upper] * n, [images_dir] * n))
            wall = time.monotonic() - t
            assert all(ask(d.ip) == str(dumped) for d in done), "a fork lost its memory state"
            entry = out["forks"].setdefault(str(n), {"wall_s": [], "steps": {}})
            entry["wall_s"].append(wall)
            for cid, d in zip(ids, done, strict=True):
                for step, s in d.timings.items():
                    entry["steps"].setdefault(step, []).append(s)
                entry["steps"].setdefault("criu_own", []).append(criu_seconds(b.base / "work" / cid / "restore.log"))
            for cid in ids:
                b.launcher.remove(cid)
        shutil.rmtree(images_dir, ignore_errors=True)
    out["dump_s"] = statistics.median(out["dump_s"])
    for entry in out["forks"].values():
        entry["wall_s"] = statistics.median(entry["wall_s"])
        entry["steps"] = {k: statistics.median(v) for k, v in entry["steps"].items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-results/runc_restore.json"))
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--forks", type=int, nargs="+", default=[1, 4, 8])
    args = ap.parse_args()
    b = Bench(Path(f"/tmp/crab-runc-bench-{os.getpid()}"))
    try:
        b.network.ensure()
        result = run(b, args.mb, args.reps, args.forks)
    finally:
        b.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
