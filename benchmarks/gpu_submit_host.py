"""The host's share of a one-block `submit`, measured on any machine (no GPU needed):
the checks, the mapping, the copy plan and the worker's bookkeeping, with the device
replaced by a stand-in whose streams, events and batched-memcpy entry point cost
nothing (a C function that returns 0). What this leaves out is what the driver and
torch's CUDA calls cost on a real device; `benchmarks/gpu_one_block.py` measures those
on one.

    python benchmarks/gpu_submit_host.py [--page 64KiB] [--layers 32] [--blocks 1] [--samples 2000]

Prints the median and 10th/90th percentiles of `submit` per copy backend it can drive
on this machine (DMA through the batched path; the bounded kernel's host side where
its plan can be built without a GPU)."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import statistics
import time
from typing import Any

import torch

from tierkv.cli.common import size
from tierkv.gpu import TransferSpec, TransferWorker
from tierkv.gpu.backends import DmaCopy
from tierkv.gpu.cuda_batch import ABI_13_0, SIGNATURES, BatchMemcpy
from tierkv.gpu.options import Backends
from tierkv.layout import GroupSpec, KVLayout
from tierkv.primary import PrimaryTier


class _Stream:
    cuda_stream = 0


class _Done:
    event = None

    def query(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def seconds(self) -> float:
        return 0.0


class StandInStreams:
    """An asynchronous device whose stream work runs at once and costs nothing else."""

    asynchronous = True

    def new_stream(self) -> _Stream:
        return _Stream()

    def order_after(self, stream: Any, ready: Any) -> None:
        return None

    def launch(self, stream: Any, work: Any, *, current: bool = True) -> _Done:
        work(stream)
        return _Done()


def free_entry_point() -> Any:
    """A C function that takes anything and returns 0 (`fegetround`: FE_TONEAREST)."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    return SIGNATURES[ABI_13_0](ctypes.cast(libm.fegetround, ctypes.c_void_p).value)


def build(page: int, layers: int, gpu_blocks: int) -> tuple[TransferWorker, PrimaryTier]:
    kv = [torch.zeros(gpu_blocks, page, dtype=torch.uint8) for _ in range(layers)]
    primary = PrimaryTier(64, layers * page)
    layout = KVLayout(block_bytes=layers * page, groups=(GroupSpec(block_size=16),))
    worker = TransferWorker(
        [kv],
        primary.view,
        layout,
        gpu_block_size=16,
        copy_backend="dma",
        ready=object(),
        streams=StandInStreams(),
    )
    dma = DmaCopy(
        [kv],
        primary.view.tensor,
        worker.geometry,
        executor="batched",
        batch=BatchMemcpy(free_entry_point(), ABI_13_0),
    )
    worker._backends = Backends(None, dma)  # the stand-in device's DMA (bench only)
    return worker, primary


def measure(worker: TransferWorker, spec: TransferSpec, samples: int) -> list[float]:
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        worker.submit(spec)
        times.append(time.perf_counter() - start)
        worker.get_finished()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", type=size, default=64 << 10)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--samples", type=int, default=2000)
    args = parser.parse_args()
    worker, _primary = build(args.page, args.layers, 1024)
    n = args.blocks
    spec = TransferSpec("load", [torch.randperm(1024)[:n]], [torch.randperm(64)[:n]], [0])
    measure(worker, spec, 200)  # warm
    times = sorted(measure(worker, spec, args.samples))
    q = statistics.quantiles(times, n=10)
    print(
        f"submit, {n}-block load, {args.layers} layers x {args.page // 1024} KiB pages, "
        f"dma (batched, stand-in device): median {statistics.median(times) * 1e6:.1f} us, "
        f"p10 {q[0] * 1e6:.1f} us, p90 {q[-1] * 1e6:.1f} us ({args.samples} samples)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
