"""Benchmark: putting a process image in place for a restore, from the blob store vs from the hot cache.

    .venv/bin/python bench/hot_images.py --out bench-results/hot_images.json

A synthetic CRIU dump of ``--mb`` MB (one ``pages-1.img`` of random bytes,
as a REPL holding that much data dumps, plus small metadata files) is
stored page-deduplicated in a fresh blob store (``[checkpoint] zstd_level``
3) and kept by ``HotImages``.  Then, ``--reps`` times each, into a fresh
empty target dir on the same file system:

* ``blobs``: ``ImageStore.write_from_blobs``: read, verify and decompress
  every pack, write every page (the path before the hot cache);
* ``hot``: ``HotImages.link_into``: one hard link per file;
* ``hot_copy``: the same with links refused (EXDEV: the cache on another
  file system), so every file is copied;
* ``blobs_fork8``: eight blob-store writes, four at a time (a fork of 8
  before the hot cache: the restorer prepares 4 clones at once);
* ``fork8``: eight ``link_into`` at once from eight threads (a fork of 8);
* ``keep``: handing a fresh copy of the dump over to the cache (rename,
  chmod), the checkpoint's extra cost.

Figures are medians (and min / max) in ms.  The blob store's files are in
the page cache (just written), as they are for a recent checkpoint; the
blob path is CPU-bound here either way.  No root needed; everything made is
removed afterwards.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

from bench.results import write_json
from crabd.backends.criu.hotimages import HotImages
from crabd.backends.criu.imagestore import ImageStore
from crabd.store.fsblobs import FileBlobStore

KINDS = ("blobs", "hot", "hot_copy", "blobs_fork8", "fork8", "keep")
META = {"core-1.img": 12_000, "mm-1.img": 4_000, "files.img": 2_000, "pstree.img": 64, "inventory.img": 40}


def make_dump(d: Path, mb: int) -> Path:
    d.mkdir(parents=True)
    with open(d / "pages-1.img", "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    for name, size in META.items():
        (d / name).write_bytes(os.urandom(size))
    (d / "descriptors.json").write_text('["/dev/null","/dev/null","/dev/null"]')
    return d


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def summary(ms: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2)}


def run(base: Path, mb: int, reps: int) -> dict[str, Any]:
    blobs = FileBlobStore(base / "blobs", level=3)
    store = ImageStore(blobs)
    hot = HotImages(base / "hot", 64 << 30)
    src = make_dump(base / "dumps" / "src", mb)
    image_bytes = sum(p.stat().st_size for p in src.iterdir())
    t0 = time.perf_counter()
    image = store.store(src, None)
    store_ms = (time.perf_counter() - t0) * 1000
    spare = base / "dumps" / "spare"
    shutil.copytree(src, spare)
    assert hot.keep(image.manifest, src, "bench")
    n = 0

    def target() -> Path:
        nonlocal n
        n += 1
        t = base / "targets" / str(n)
        t.mkdir(parents=True)
        return t

    def clear_targets() -> None:
        shutil.rmtree(base / "targets", ignore_errors=True)
        os.sync()

    def link(t: Path) -> int | None:
        return hot.link_into(image.manifest, t)

    def exdev(*a: object, **kw: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    def write(t: Path) -> int:
        return store.write_from_blobs(image.manifest, t)

    results: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(reps):
        results["blobs"].append(timed(partial(store.write_from_blobs, image.manifest, target())))
        clear_targets()
        results["hot"].append(timed(partial(link, target())))
        with mock.patch("os.link", exdev):
            results["hot_copy"].append(timed(partial(link, target())))
        clear_targets()
        with ThreadPoolExecutor(8) as pool:

            def fork8(ts: list[Path], pool: ThreadPoolExecutor = pool) -> list[int | None]:
                return list(pool.map(link, ts))

            results["fork8"].append(timed(partial(fork8, [target() for _ in range(8)])))
        clear_targets()
        # The restorer writes at most FORK_PARALLEL (4) clones' files at once.
        with ThreadPoolExecutor(4) as pool:

            def blobs8(ts: list[Path], pool: ThreadPoolExecutor = pool) -> list[int]:
                return list(pool.map(write, ts))

            results["blobs_fork8"].append(timed(partial(blobs8, [target() for _ in range(8)])))
        clear_targets()
        # keep(): a fresh dump dir of the same image (a second manifest name, so it is really taken over).
        fresh = base / "dumps" / "fresh"
        shutil.copytree(spare, fresh)
        other = f"{int(image.manifest, 16) ^ 1:064x}"
        results["keep"].append(timed(partial(hot.keep, other, fresh, "bench-2")))
        hot.drop(other)
    return {
        "mb": mb,
        "image_bytes": image_bytes,
        "store_ms": round(store_ms, 1),
        "stored_bytes": image.new_bytes,
        "reps": reps,
        **{k: summary(v) for k, v in results.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp", help="where to work (the state dir's file system)")
    ap.add_argument("--out", default="bench-results/hot_images.json")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="crab-hot-bench-", dir=args.dir))
    try:
        out = run(base, args.mb, args.reps)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"wrote {write_json(out, args.out)}", file=sys.stderr)
    print(f"{args.mb} MB image, medians of {args.reps} (ms):\n")
    print("| blob store write | hot link | hot copy (EXDEV) | 8 blob writes, 4 at once | 8 hot links at once | keep |")
    print("|---|---|---|---|---|---|")
    print("| " + " | ".join(f"{out[k]['median_ms']:.1f}" for k in KINDS) + " |")


if __name__ == "__main__":
    main()
