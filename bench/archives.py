"""Benchmark: portable checkpoint archives — export time, archive size, import time (issue 23).

    .venv/bin/python bench/archives.py --out bench-results/archives.json

The two sandboxes of ``bench/processes.py`` (small: bash and a Python HTTP
server; big: the same plus a REPL holding 200 MB of random data), each with
one full checkpoint (files, session, CRIU images).  Two private crabds: the
source, where the sandbox runs, and a target with an empty store (a fresh
host).  Each rep exports the checkpoint from the source to a file (the
SDK's ``export_checkpoint``, client-measured, the file written and fsync'd),
then imports that file into the target (``import_checkpoint``: every hash
verified, blobs staged, moved into the store, adopted), then deletes it
there so the next rep imports into an empty store again.  After the reps
the target forks the checkpoint once and checks the HTTP server answers.
Medians of ``--reps`` runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.backends import BACKENDS, daemon_on, parse_backends
from bench.processes import ASK, setup
from bench.results import write_json
from crabd.sdk import Client
from crabd.trust.keys import PUB_FILE, TRUSTED_DIR


def bench(src: Client, dst: Client, name: str, big_mb: int, reps: int, tmp: Path) -> dict[str, Any]:
    sb = setup(src, big_mb)
    try:
        ck = sb.checkpoint("archived", kind="full")
        exports: list[float] = []
        imports: list[float] = []
        size = stored = 0
        for i in range(reps):
            path = tmp / f"{i}.crab"
            t = time.perf_counter()
            size = src.export_checkpoint(ck, path)
            exports.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = dst.import_checkpoint(path)
            imports.append(time.perf_counter() - t)
            stored = got.stored_blobs
            assert got.checkpoint.kind == "full" and not got.dropped, got.dropped
            if i < reps - 1:
                dst.delete_checkpoint(ck.id)
            path.unlink()
        clone = dst.fork(ck.id, 1)[0]
        try:
            assert clone.session.run(ASK).stdout == b"200\n", "the imported checkpoint's server does not answer"
        finally:
            clone.remove(force=True)
            dst.delete_checkpoint(ck.id)
        return {
            "sandbox": name,
            "big_mb": big_mb,
            "archive_bytes": size,
            "blobs": stored,
            "export_p50_s": statistics.median(exports),
            "import_p50_s": statistics.median(imports),
            "export_s": exports,
            "import_s": imports,
            "export_mb_s": size / statistics.median(exports) / 1e6,
            "import_mb_s": size / statistics.median(imports) / 1e6,
        }
    finally:
        sb.remove(force=True)


def table(backend: str, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"backend {backend}",
        f"{'sandbox':34} {'archive':>10} {'blobs':>6} {'export p50':>11} {'import p50':>11}",
    ]
    for r in rows:
        lines.append(
            f"{r['sandbox']:34} {r['archive_bytes'] / 1e6:>8.1f}MB {r['blobs']:>6}"
            f" {r['export_p50_s'] * 1000:>9.0f}ms {r['import_p50_s'] * 1000:>9.0f}ms"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results/archives.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--big-mb", type=int, default=200)
    ap.add_argument("--backends", default="docker", help=f"comma-separated, of {', '.join(BACKENDS)}")
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    text = []
    for backend in parse_backends(args.backends):
        with (
            daemon_on(backend) as a,
            daemon_on(backend) as b,
            Client(a.socket, timeout=1800) as src,
            Client(b.socket, timeout=1800) as dst,
            tempfile.TemporaryDirectory(prefix="crab-bench-archives-") as tmp,
        ):
            # The target trusts the source's host key (crabd/trust/keys.py), as hosts of one cluster do:
            # otherwise it imports files and session only.
            trusted = b.state_dir / "trust" / TRUSTED_DIR / "source.pub"
            shutil.copyfile(a.state_dir / "trust" / PUB_FILE, trusted)
            os.chmod(trusted, 0o644)
            rows = []
            for name, mb in (
                ("small: bash + HTTP server", 0),
                (f"big: + a REPL holding {args.big_mb} MB", args.big_mb),
            ):
                print(f"[bench] {backend}: {name} ...", file=sys.stderr)
                rows.append({"backend": backend, **bench(src, dst, name, mb, args.reps, Path(tmp))})
            results += rows
            text.append(table(backend, rows))
    out = write_json({"time": time.time(), "reps": args.reps, "results": results}, args.out)
    print("\n\n".join(text))
    print(f"\n(JSON: {out})")


if __name__ == "__main__":
    main()
