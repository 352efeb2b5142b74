"""On a CUDA machine: the bounded copy kernel's shape against its cost to the model.
For 16 KiB pages, per (words per step, warps, thread blocks): store and load as a
ratio of one contiguous copy, and how much slower concurrent bf16 matmuls ran. What
`tierkv.gpu.bounded.DEFAULT_PROGRAMS` and `tierkv.gpu.triton_pages.CHUNK` /
`NUM_WARPS` are chosen from.

    python benchmarks/gpu_bounded_sweep.py [--page 16KiB] [--total 128MiB]

Without CUDA it says so and exits 0."""

from __future__ import annotations

import argparse

import torch

from tierkv.cli.common import size
from tierkv.gpu import bench, triton_pages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", type=size, default=16 << 10)
    parser.add_argument("--total", type=size, default=128 << 20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bounded_sweep: no CUDA device here")
        return 0
    print(f"bounded kernel, {args.page // 1024} KiB pages, 32 layers, {args.total >> 20} MiB")
    print("chunk warps programs | store load | matmul +% store/load")
    for chunk in (1024, 4096):
        for warps in (4, 8):
            triton_pages.CHUNK, triton_pages.NUM_WARPS = chunk, warps
            for programs in (8, 16, 32):
                row = bench._measured(
                    args.total, 2, args.page, "bounded", num_layers=32, programs=programs
                )
                print(
                    f"{chunk:>5} {warps:>5} {programs:>8} | {row['store_ratio']:.2f} "
                    f"{row['load_ratio']:.2f} | {100 * row['matmul_slowdown_store']:.0f}/"
                    f"{100 * row['matmul_slowdown_load']:.0f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
