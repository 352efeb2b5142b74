"""vLLM's own `fs` secondary tier against tierkv's `nvme` tier, both under the same
vLLM `TieringOffloadingManager` (the installed wheel), on the same blocks.

    .venv/bin/python scripts/bench_vllm_tiers.py [--blocks 128] [--row-kib 1024] [--repeat 3]

For each tier: store throughput (complete_store's cascade until every job is
reported), promotion throughput (a restarted engine, page cache dropped for the
files, looks a request's blocks up until all are HITs in its primary), and the
scheduler-thread cost of one step's lookups of 1,000 blocks no tier holds (the first
pass, which queues them, and the pass once the answers are in). The best of
`--repeat` runs; one JSON line per tier.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integrations"))
from conftest import Engine, make_keys, payload  # the tests' vLLM driver


def drop_page_cache(root: Path) -> None:
    """Make the next reads come from the disk (vLLM's fs tier reads O_DIRECT anyway)."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def one_run(entry: dict[str, Any], root: Path, blocks: int, row: int) -> dict[str, float]:
    keys = make_keys(blocks, f"bench-{time.monotonic_ns()}")
    writer = Engine([entry], chunks=blocks + 8, row=row)
    ctx = writer.new_request()
    with writer.manager.lock:
        out = writer.manager.prepare_store(keys, ctx)
        assert out is not None and len(out.keys_to_store) == blocks
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
            writer.view[int(chunk) * row : (int(chunk) + 1) * row] = payload(key, row)
        t0 = time.perf_counter()
        writer.manager.complete_store(keys, ctx, True)
    writer.finish(ctx)
    writer.settle(timeout=600)
    store_s = time.perf_counter() - t0
    writer.shutdown()
    drop_page_cache(root)

    reader = Engine([entry], chunks=blocks + 8, row=row)
    ctx = reader.new_request()
    t0 = time.perf_counter()
    hits = reader.promote(ctx, keys, timeout=600)
    promote_s = time.perf_counter() - t0
    assert hits == blocks, f"promoted {hits} of {blocks}"
    assert reader.read(ctx, keys[:1]) == [payload(keys[0], row)]
    reader.finish(ctx)

    first_ms, answered_ms = lookup_cost(reader)
    reader.shutdown()
    mib = blocks * row / (1 << 20)
    return {
        "store_MiB_s": mib / store_s,
        "promote_MiB_s": mib / promote_s,
        "lookup_1000_first_ms": first_ms,
        "lookup_1000_answered_ms": answered_ms,
    }


def lookup_cost(engine: Engine) -> tuple[float, float]:
    """Milliseconds the scheduler thread spends in one step's lookups of 1,000 blocks
    no tier holds: the first pass (answers not in yet) and the pass once they are."""
    from vllm.v1.kv_offload.base import LookupResult

    absent = make_keys(1000, f"absent-{time.monotonic_ns()}")
    probe = engine.new_request()
    with engine.manager.lock:
        t0 = time.perf_counter()
        for key in absent:
            engine.manager.lookup(key, probe)
        first_s = time.perf_counter() - t0
    engine.settle(lambda: engine.lookup(probe, absent[-1]) is not LookupResult.RETRY, 60)
    with engine.manager.lock:
        t0 = time.perf_counter()
        answers = [engine.manager.lookup(key, probe) for key in absent]
        answered_s = time.perf_counter() - t0
    assert all(a is LookupResult.MISS for a in answers)
    engine.finish(probe)
    return first_s * 1e3, answered_s * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--blocks", type=int, default=128, help="blocks stored and promoted per run (128)"
    )
    parser.add_argument(
        "--row-kib", type=int, default=1024, help="KiB per block: one chunk's row (1024)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per tier; the best is kept (3)")
    parser.add_argument(
        "--dir",
        default=None,
        help="where the tiers write, in subdirectories removed after each run (default: a "
        "temporary directory, removed at the end)",
    )
    args = parser.parse_args()
    row = args.row_kib << 10
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tierkv-vllm-bench-"))
    capacity = f"{2 * args.blocks * (row + 8192)}"
    tiers: dict[str, Any] = {
        "vllm fs": lambda root: {"type": "fs", "root_dir": str(root)},
        "tierkv nvme (fsync always)": lambda root: {
            "type": "tierkv",
            "tier": {"type": "nvme", "path": str(root), "capacity": capacity},
        },
        "tierkv nvme (fsync never)": lambda root: {
            "type": "tierkv",
            "tier": {"type": "nvme", "path": str(root), "capacity": capacity, "fsync": "never"},
        },
    }
    bare = Engine([], chunks=8, row=row)  # vLLM's manager and primary, no secondary
    costs = [lookup_cost(bare) for _ in range(args.repeat)]
    bare.shutdown()
    print(
        json.dumps(
            {
                "tier": "none (vLLM's manager + CPU primary only)",
                "lookup_1000_first_ms": min(c[0] for c in costs),
                "lookup_1000_answered_ms": min(c[1] for c in costs),
            }
        )
    )
    for name, make in tiers.items():
        runs = []
        for i in range(args.repeat):
            root = base / f"{name.split()[1]}-{i}"
            runs.append(one_run(make(root), root, args.blocks, row))
            shutil.rmtree(root, ignore_errors=True)
        best = {
            "store_MiB_s": max(r["store_MiB_s"] for r in runs),
            "promote_MiB_s": max(r["promote_MiB_s"] for r in runs),
            "lookup_1000_first_ms": min(r["lookup_1000_first_ms"] for r in runs),
            "lookup_1000_answered_ms": min(r["lookup_1000_answered_ms"] for r in runs),
        }
        print(json.dumps({"tier": name, "blocks": args.blocks, "row_bytes": row, **best}))
    if not args.dir:  # a directory given is the caller's: only the runs' own are removed
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
