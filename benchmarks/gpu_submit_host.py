"""The host's share of a one-block `submit`, measured on any machine (no GPU needed):
the checks, the mapping, the copy plan and the worker's bookkeeping, with the device
replaced by a stand-in whose streams, events and batched-memcpy entry point cost
nothing (a C function that returns 0). What this leaves out is what the driver and
torch's CUDA calls cost on a real device; `benchmarks/gpu_one_block.py` measures those
on one.

    python benchmarks/gpu_submit_host.py [--page 64KiB] [--layers 32] [--blocks 1]
        [--samples 2000] [--copy-us 40] [--queued-us 5000]

Prints the median and 10th/90th percentiles of `submit` per copy backend it can drive
on this machine (DMA through the batched path; the bounded kernel's host side where
its plan can be built without a GPU). Then the same from an event loop with copies that
end `--copy-us` after their launch: `submit`, and submit to the awaited result (the
completion side: the completion thread, or the waiter looking from the loop). Last,
copies queued `--queued-us` behind `ready` before they begin: how often a waiter
looks at one, with the start check and without it."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import statistics
import time
from typing import Any

import anyio
import numpy as np
import torch

from tierkv.cli.common import size
from tierkv.gpu import TransferSpec, TransferWorker
from tierkv.gpu.backends import DmaCopy
from tierkv.gpu.bounded import BoundedKernelCopy, triton_missing
from tierkv.gpu.cuda_batch import ABI_13_0, SIGNATURES, BatchMemcpy
from tierkv.gpu.graphs import GRAPH_MAX_BLOCKS, GRAPH_SLOTS, GraphTable, Slot, SlotRing
from tierkv.gpu.options import Backends
from tierkv.layout import GroupSpec, KVLayout
from tierkv.primary import PrimaryTier


class _Stream:
    cuda_stream = 0


class _Done:
    event = None

    def query(self) -> bool:
        return True

    def started(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def seconds(self) -> float:
        return 0.0


class _Timed:
    """A copy that begins `queued` seconds after its launch (behind `ready`) and ends
    `seconds` later, as a device's would: `query` and `started` look at the clock,
    `wait` sleeps (releasing the GIL, like a blocking-sync event)."""

    event = None

    def __init__(self, seconds: float, queued: float = 0.0) -> None:
        now = time.perf_counter()
        self._begin = now + queued
        self._end = now + queued + seconds
        self._seconds = seconds

    def query(self) -> bool:
        return time.perf_counter() >= self._end

    def started(self) -> bool:
        return time.perf_counter() >= self._begin

    def wait(self) -> None:
        left = self._end - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def seconds(self) -> float:
        return self._seconds


class _Recorded:
    """A slot's event: recorded, and done at once."""

    def record(self, stream: Any) -> None:
        return None

    def query(self) -> bool:
        return True


class StandInStreams:
    """An asynchronous device whose stream work runs at once and costs nothing else;
    with `copy_seconds` each copy is reported done that long after its launch."""

    asynchronous = True

    def __init__(self, copy_seconds: float = 0.0, queued_seconds: float = 0.0) -> None:
        self.copy_seconds = copy_seconds
        self.queued_seconds = queued_seconds

    def new_stream(self) -> _Stream:
        return _Stream()

    def order_after(self, stream: Any, ready: Any) -> None:
        return None

    def launch(self, stream: Any, work: Any, *, current: bool = True) -> _Done | _Timed:
        work(stream)
        if not self.copy_seconds:
            return _Done()
        return _Timed(self.copy_seconds, self.queued_seconds)


def free_entry_point() -> Any:
    """A C function that takes anything and returns 0 (`fegetround`: FE_TONEAREST)."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    return SIGNATURES[ABI_13_0](ctypes.cast(libm.fegetround, ctypes.c_void_p).value)


def build(
    page: int,
    layers: int,
    gpu_blocks: int,
    backend: str = "dma",
    copy_seconds: float = 0.0,
    queued_seconds: float = 0.0,
) -> tuple[TransferWorker, PrimaryTier]:
    """A worker on the stand-in device: `dma` through the batched path, or `bounded`
    with every small transfer "replayed" from a stand-in graph (a slot whose replay
    does nothing): the host's share of the graph path."""
    kv = [torch.zeros(gpu_blocks, page, dtype=torch.uint8) for _ in range(layers)]
    primary = PrimaryTier(64, layers * page)
    layout = KVLayout(block_bytes=layers * page, groups=(GroupSpec(block_size=16),))
    worker = TransferWorker(
        [kv],
        primary.view,
        layout,
        gpu_block_size=16,
        copy_backend="bounded" if backend == "bounded" else "dma",
        ready=object(),
        streams=StandInStreams(copy_seconds, queued_seconds),
    )
    if backend == "bounded":
        small = worker._backends.small
        assert isinstance(small, BoundedKernelCopy)
        small.graphs = GraphTable(
            {
                (0, store, n): SlotRing(
                    [
                        Slot(np.zeros(2 * n, np.int64), lambda stream: None, _Recorded())
                        for _ in range(GRAPH_SLOTS)
                    ]
                )
                for store in (True, False)
                for n in range(1, GRAPH_MAX_BLOCKS + 1)
            }
        )
        return worker, primary
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


def measure_awaited(
    worker: TransferWorker, spec: TransferSpec, samples: int
) -> tuple[list[float], list[float]]:
    """`submit` alone and submit to `await worker.wait(...)`, in seconds, from one
    event loop (the completion side: a copy that ends later is watched and woken)."""
    submits, awaited, _looks = measure_waits(worker, spec, samples)
    return submits, awaited


def measure_waits(
    worker: TransferWorker, spec: TransferSpec, samples: int
) -> tuple[list[float], list[float], float]:
    """`measure_awaited`, plus how often per wait the worker looked at its copies
    (its `_reap`: once per pass of the loop while a waiter polls)."""
    submits, awaited = [], []
    looks = 0
    reap = worker._reap

    def counted() -> None:
        nonlocal looks
        looks += 1
        reap()

    worker._reap = counted  # type: ignore[method-assign]

    async def run() -> None:
        for _ in range(samples):
            start = time.perf_counter()
            handle = worker.submit(spec)
            submits.append(time.perf_counter() - start)
            await worker.wait(handle)
            awaited.append(time.perf_counter() - start)

    try:
        anyio.run(run)
    finally:
        worker._reap = reap  # type: ignore[method-assign]
    return submits, awaited, looks / samples


def _us(times: list[float]) -> str:
    q = statistics.quantiles(times, n=10)
    return (
        f"median {statistics.median(times) * 1e6:.1f} us, "
        f"p10 {q[0] * 1e6:.1f}, p90 {q[-1] * 1e6:.1f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", type=size, default=64 << 10)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument(
        "--queued-us",
        type=float,
        default=5000.0,
        help="for the last rows: copies begin this long after launch (behind ready)",
    )
    parser.add_argument(
        "--copy-us",
        type=float,
        default=40.0,
        help="for the awaited rows: each stand-in copy ends this long after its launch",
    )
    args = parser.parse_args()
    n = args.blocks
    spec = TransferSpec("load", [torch.randperm(1024)[:n]], [torch.randperm(64)[:n]], [0])
    backends = {"dma": "dma (batched, stand-in device)"}
    if triton_missing() is None and n <= GRAPH_MAX_BLOCKS:
        backends["bounded"] = "bounded (graph replay, stand-in device)"
    for backend, label in backends.items():
        worker, _primary = build(args.page, args.layers, 1024, backend)
        measure(worker, spec, 200)  # warm
        times = sorted(measure(worker, spec, args.samples))
        q = statistics.quantiles(times, n=10)
        print(
            f"submit, {n}-block load, {args.layers} layers x {args.page // 1024} KiB pages, "
            f"{label}: median {statistics.median(times) * 1e6:.1f} us, "
            f"p10 {q[0] * 1e6:.1f} us, p90 {q[-1] * 1e6:.1f} us ({args.samples} samples)"
        )
    copy = args.copy_us / 1e6
    for backend, label in backends.items():
        worker, _primary = build(args.page, args.layers, 1024, backend, copy)
        measure_awaited(worker, spec, 100)  # warm
        submits, awaited = measure_awaited(worker, spec, args.samples // 2)
        print(
            f"awaited, copies ending {args.copy_us:.0f} us after launch, {label}: "
            f"submit {_us(submits)}; submit to awaited {_us(awaited)}"
        )
        worker.close()
    if "bounded" in backends:
        queued = args.queued_us / 1e6
        for window in (200.0, None):
            worker, _primary = build(args.page, args.layers, 1024, "bounded", copy, queued)
            if window is None:  # the start check defeated: the whole window is looked at
                worker._streams.launch = _always_started(worker._streams.launch)  # type: ignore[method-assign]
            _s, awaited, looks = measure_waits(worker, spec, 100)
            label = "looked at while queued" if window is None else "start check"
            print(
                f"awaited, copies queued {args.queued_us:.0f} us then {args.copy_us:.0f} us, "
                f"bounded, {label}: {looks:.1f} looks per wait, submit to awaited "
                f"{_us(awaited)}"
            )
            worker.close()
    return 0


def _always_started(launch: Any) -> Any:
    """A stand-in launch whose copies say they have begun at once (what a waiter did
    before it looked at the start event)."""

    def launched(stream: Any, work: Any, *, current: bool = True) -> Any:
        copy = launch(stream, work, current=current)
        copy.started = lambda: True
        return copy

    return launched


if __name__ == "__main__":
    raise SystemExit(main())
