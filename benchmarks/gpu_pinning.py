"""On a CUDA machine: how much host memory a primary pins, tierkv's way (an exact-size
`mmap` registered with `cudaHostRegister`) against torch's pinned allocator (which
rounds up to a power of two), and whether the registered slab copies to the GPU as
fast as torch's pinned memory.

    python benchmarks/gpu_pinning.py [--sizes 32GiB,24GiB]

Per size it prints the pinned bytes tierkv reports, how much `MemAvailable`
(/proc/meminfo) dropped and this process's RSS grew, and the seconds pinning took;
then torch's `empty(..., pin_memory=True)` of the last size; then 1 GiB host-to-device
and device-to-host copies from each kind of memory.
Without CUDA it says so and exits 0."""

from __future__ import annotations

import argparse
import functools
import gc
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from tierkv.cli.common import size as parse_size
from tierkv.contract.units import format_size
from tierkv.primary import PrimaryTier

BLOCK = 2 << 20
T = TypeVar("T")


def meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


def measured(make: Callable[[], T]) -> tuple[T, dict[str, float]]:
    avail, mine = meminfo("MemAvailable"), rss()
    start = time.perf_counter()
    thing = make()
    seconds = time.perf_counter() - start
    return thing, {
        "seconds": seconds,
        "MemAvailable_drop": avail - meminfo("MemAvailable"),
        "rss_growth": rss() - mine,
    }


def show(label: str, figures: dict[str, float]) -> None:
    parts = [f"{k} {format_size(int(v))}" for k, v in figures.items() if k != "seconds"]
    print(f"{label}: {', '.join(parts)}; {figures['seconds']:.1f} s", flush=True)


def copy_rate(host: torch.Tensor, repeats: int = 5) -> tuple[float, float]:
    """Best GB/s of a host->device and a device->host copy of `host` (1-D uint8)."""
    device = torch.empty_like(host, device="cuda")
    rates = []
    for direction in ("h2d", "d2h"):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if direction == "h2d":
                device.copy_(host, non_blocking=True)
            else:
                host.copy_(device, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        rates.append(host.numel() / best / 1e9)
    return rates[0], rates[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="32GiB,24GiB")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_pinning: no CUDA device here; nothing pinned")
        return 0
    torch.cuda.init()  # type: ignore[no-untyped-call]
    sizes = [int(parse_size(s)) for s in args.sizes.split(",")]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    last = None
    for size in sizes:
        primary, figures = measured(
            functools.partial(PrimaryTier, size // BLOCK, BLOCK, pin_memory=True)
        )
        show(
            f"tierkv primary {format_size(size)} (pinned_bytes "
            f"{format_size(primary.memory.pinned_bytes)}, is_pinned "
            f"{primary.view.tensor.is_pinned()})",
            figures,
        )
        if last is not None:
            last.memory.close()
        last = primary
    assert last is not None
    gib = last.view.tensor.view(-1)[: 1 << 30]
    h2d, d2h = copy_rate(gib)
    print(f"1 GiB from the registered slab: h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s")
    last.memory.close()
    del last, gib
    gc.collect()
    pinned, figures = measured(lambda: torch.empty(sizes[-1], dtype=torch.uint8, pin_memory=True))
    show(f"torch.empty({format_size(sizes[-1])}, pin_memory=True)", figures)
    h2d, d2h = copy_rate(pinned[: 1 << 30])
    print(f"1 GiB from torch's pinned memory: h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s")
    pageable = torch.empty(1 << 30, dtype=torch.uint8)
    pageable.fill_(1)
    h2d, d2h = copy_rate(pageable)
    print(f"1 GiB from pageable memory: h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
