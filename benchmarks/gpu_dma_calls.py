"""On a CUDA machine: batched-DMA throughput by page size and copies per driver call
(`max_copies_per_call`), to choose that default from a measurement. Each row moves
`--total` bytes of random GPU blocks to random slots of a registered primary, store
then load, best of `--repeats`, next to one contiguous copy of the same bytes.

    python benchmarks/gpu_dma_calls.py [--pages 16KiB,64KiB] [--calls 1024,8192,32768]

Without CUDA it says so and exits 0."""

from __future__ import annotations

import argparse
import functools
import time

import torch

from tierkv.cli.common import size
from tierkv.gpu import TransferSpec, TransferWorker
from tierkv.layout import GroupSpec, KVLayout
from tierkv.primary import PrimaryTier

LAYERS = 32


def best_s(run, repeats: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def sweep(page: int, calls_list: list[int], total: int, repeats: int) -> None:
    gen = torch.Generator().manual_seed(page)
    blocks = max(1, total // (LAYERS * page))
    kv = [torch.zeros(2 * blocks, page, dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
    primary = PrimaryTier(blocks, LAYERS * page, pin_memory=True)
    layout = KVLayout(block_bytes=LAYERS * page, groups=(GroupSpec(block_size=16),))
    ids = torch.randperm(2 * blocks, generator=gen)[:blocks]
    slots = torch.randperm(blocks, generator=gen)
    moved = blocks * LAYERS * page
    flat = primary.view.tensor.view(-1)
    on_gpu = torch.empty(moved, dtype=torch.uint8, device="cuda")
    raw_store = best_s(lambda: flat.copy_(on_gpu, non_blocking=True), repeats)
    raw_load = best_s(lambda: on_gpu.copy_(flat, non_blocking=True), repeats)
    for calls in calls_list:
        worker = TransferWorker(
            [kv],
            primary.view,
            layout,
            gpu_block_size=16,
            copy_backend="dma",
            dma_executor="batched",
            ready=torch.cuda.current_stream(),
            max_copies_per_call=calls,
        )
        store_spec = TransferSpec("store", [ids], [slots], [0])
        load_spec = TransferSpec("load", [ids], [slots], [0])
        store = best_s(functools.partial(worker.submit, store_spec), repeats)
        load = best_s(functools.partial(worker.submit, load_spec), repeats)
        worker.get_finished()
        stats = worker.batch_stats
        assert stats is not None
        print(
            f"{page // 1024:>4} KiB {calls:>6}            | "
            f"{moved / store / 1e9:>10.1f} {raw_store / store:>7.2f} | "
            f"{moved / load / 1e9:>9.1f} {raw_load / load:>7.2f} | "
            f"{stats.calls} ({stats.failed_calls} failed)",
            flush=True,
        )
        worker.close()
    primary.memory.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", default="16KiB,64KiB")
    parser.add_argument("--calls", default="1024,8192,32768")
    parser.add_argument("--total", type=size, default=256 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_dma_calls: no CUDA device here")
        return 0
    print("page      calls/driver call | store GB/s (ratio) | load GB/s (ratio) | calls")
    for page in (size(p) for p in args.pages.split(",")):
        sweep(page, [int(c) for c in args.calls.split(",")], args.total, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
