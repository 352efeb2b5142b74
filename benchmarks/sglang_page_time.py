"""Where a page's CPU goes through SGLang's storage interface: per thread, per page.

tierkv's backend over the bench's host pool (`scripts/bench_sglang.py`'s stand-in with
SGLang's page arithmetic), `batch_set_v1` then `batch_get_v1` of --batches calls of 128
pages, --passes times; each thread's CPU from `/proc/self/task/<tid>/schedstat`
(nanoseconds), divided by the pages moved:

- SGLang's thread: the caller (SGLang's controller thread); within it SGLang's own
  `get_page_buffer_meta` and the adapter's page keys (a blake2b per page);
- the event-loop thread: tierkv's loop (the tier driver, the job, the nvme tier's index);
- worker and core threads: the rest of the process (the worker thread that calls the
  nvme core, and the core's own threads, which live for one call).

Prints the least and the median over the passes. From the page cache (tmpfs by
default); `fsync: never`.

    .venv/bin/python benchmarks/sglang_page_time.py [--page-kib 64] [--layout page_first]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_sglang as bench

import tierkv.integrations.sglang.regions as regions


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by its Python name."""
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stat:
                ns = int(stat.read().split()[0])
        except OSError:
            continue
        name = names.get(tid, "native")
        out[f"{name}:{tid}"] = ns / 1e9
    return out


def process_cpu() -> float:
    return time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)


class Pieces:
    """Thread CPU of named calls made on SGLang's thread."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner: Any, name: str, piece: str) -> None:
        real = getattr(owner, name)
        self.seconds[piece] = 0.0

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds[piece] += time.thread_time() - started

        setattr(owner, name, timed)

    def reset(self) -> None:
        for piece in self.seconds:
            self.seconds[piece] = 0.0


def main(args: argparse.Namespace) -> None:
    root = Path(args.dir) / f"tierkv-sglang-page-time-{os.getpid()}"
    pages = 2 * args.batches * bench.BATCH
    pool = bench.pool_of(args.page_kib, pages, 2, args.layout)
    pieces = Pieces()
    pieces.wrap(regions, "whole_page_keys", "page keys")
    pieces.wrap(pool, "get_page_buffer_meta", "get_page_buffer_meta")
    tier = {"type": "nvme", "path": str(root), "capacity": f"{8 * pages * args.page_kib}KiB",
            "fsync": "never"}
    backend = bench.build("dynamic", {**bench.TIERKV, "tiers": [tier]}, pool)
    n = args.batches * bench.BATCH
    bench.fill(pool, list(range(n)), 1)
    rows: dict[tuple[str, str], list[float]] = {}
    try:
        for p in range(args.passes):
            keys = [f"p{p}-{i:08x}" for i in range(n)]
            calls = range(args.batches)
            src = [pool.indices(list(range(b * bench.BATCH, (b + 1) * bench.BATCH))) for b in calls]
            dst = [pool.indices(list(range(n + b * bench.BATCH, n + (b + 1) * bench.BATCH)))
                   for b in calls]
            for op, where in (("set", src), ("get", dst)):
                pieces.reset()
                before, cpu, wall = thread_cpu(), process_cpu(), time.perf_counter()
                main_cpu = time.thread_time()
                for b in calls:
                    batch = keys[b * bench.BATCH : (b + 1) * bench.BATCH]
                    call = backend.batch_set_v1 if op == "set" else backend.batch_get_v1
                    if not all(call(batch, where[b])):
                        raise RuntimeError(f"a {op} missed")
                main_cpu = time.thread_time() - main_cpu
                wall, cpu = time.perf_counter() - wall, process_cpu() - cpu
                after = thread_cpu()
                loop = sum(after[k] - before[k] for k in after
                           if k in before and k.startswith("tierkv-engine-loop"))
                per = {
                    "wall": wall,
                    "CPU, all threads": cpu,
                    "SGLang's thread": main_cpu,
                    "  get_page_buffer_meta": pieces.seconds["get_page_buffer_meta"],
                    "  page keys": pieces.seconds["page keys"],
                    "event-loop thread": loop,
                    "worker and core threads": cpu - main_cpu - loop,
                }
                for what, seconds in per.items():
                    rows.setdefault((op, what), []).append(seconds / n * 1e6)
    finally:
        backend.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.page_kib} KiB pages, {args.layout}, {args.passes} passes of {n} pages, "
          f"under {args.dir}: µs per page, least (median)")
    for (op, what), values in rows.items():
        print(f"{op}  {what:26s} {min(values):7.1f} ({statistics.median(values):.1f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-kib", type=int, default=64, choices=(64, 1024))
    parser.add_argument("--layout", default="page_first", choices=("page_first", "layer_first"))
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm")
    main(parser.parse_args())
