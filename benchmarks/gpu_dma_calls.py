"""On a CUDA machine: batched-DMA throughput by page size and copies per driver call
(`max_copies_per_call`), to choose that default from a measurement. Each row is
`tierkv.gpu.bench.benchmark` with the DMA backend: `--total` bytes of random GPU blocks
to random slots (32 layers), store then load, best of `--repeats`, next to one
contiguous copy of the same bytes.

    python benchmarks/gpu_dma_calls.py [--pages 16KiB,64KiB] [--calls 1024,8192,32768]

Without CUDA it says so and exits 0."""

from __future__ import annotations

import argparse

import torch

from tierkv.cli.common import size
from tierkv.gpu.bench import benchmark


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
        for calls in (int(c) for c in args.calls.split(",")):
            row = benchmark(
                args.total,
                page_bytes=page,
                repeats=args.repeats,
                device="cuda",
                copy_backend="dma",
                max_copies_per_call=calls,
            )
            print(
                f"{page // 1024:>4} KiB {calls:>6}            | "
                f"{row['store_GBps']:>10.1f} {row['store_ratio']:>7.2f} | "
                f"{row['load_GBps']:>9.1f} {row['load_ratio']:>7.2f} | "
                f"{row['batched_calls']}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
