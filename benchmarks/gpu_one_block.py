"""On a CUDA machine: where the time of a one-block load goes. Per copy backend, the
median of: `submit` alone (checks, plan, driver call: the host's share), `submit` then
`torch.cuda.synchronize()` (the copy done), and `await worker.transfer(...)` (the copy
done and the event loop told, through the completion thread).

A variant beside the backends: `bounded-nograph`, the bounded kernel launched through
Triton every time, its captured graphs set aside (what the graphs save).

    python benchmarks/gpu_one_block.py [--page 64KiB] [--layers 32] [--samples 200]
        [--no-large] [--steps]

`--steps` also times each step of every backend's `submit` inside real submits (the
worker's steps and torch's CUDA calls).

Without CUDA it says so and exits 0."""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch

from tierkv.cli.common import size
from tierkv.gpu import COPY_BACKENDS, TransferSpec, TransferWorker
from tierkv.layout import GroupSpec, KVLayout
from tierkv.primary import PrimaryTier


def submit_then_sync(worker: TransferWorker, spec: TransferSpec) -> None:
    worker.submit(spec)
    torch.cuda.synchronize()


async def longest_loop_gap_us(worker: TransferWorker, spec: TransferSpec, threaded: bool) -> float:
    """The longest the event loop went without running another task while `spec` was
    issued and awaited: through `start` (the submitter thread for large transfers) or
    through `submit` (the calling thread)."""
    gap = 0.0
    running = True

    async def ticker() -> None:
        nonlocal gap
        last = time.perf_counter()
        while running:
            await anyio.sleep(0)
            now = time.perf_counter()
            gap, last = max(gap, now - last), now

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.001)
        handle = await worker.start(spec) if threaded else worker.submit(spec)
        await worker.wait(handle)
        running = False
    return gap * 1e6


def median_us(run: Callable[[], object], samples: int) -> float:
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def cuda_parts(samples: int) -> None:
    """Medians of the CUDA calls a submit is made of, each alone: where host time goes
    besides tierkv's own Python."""
    stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    device = torch.device("cuda", torch.cuda.current_device())

    def event_pair() -> None:
        for _ in range(2):
            torch.cuda.Event(enable_timing=True, blocking=True).record(stream)

    def stream_context() -> None:
        with torch.cuda.stream(stream):
            pass

    def device_context() -> None:
        with torch.cuda.device(device):
            pass

    recorded = stream.record_event()
    parts = {
        "two timing events, created and recorded": event_pair,
        "stream.wait_stream(other)": lambda: stream.wait_stream(other),
        "with torch.cuda.stream(s)": stream_context,
        "with torch.cuda.device(d)": device_context,
        "torch.cuda.current_device()": torch.cuda.current_device,
        "event.query()": recorded.query,
        "pinned torch.empty(64, int64)": lambda: torch.empty(
            64, dtype=torch.int64, pin_memory=True
        ),
    }
    for name, run in parts.items():
        print(f"  part: {name}: {median_us(run, samples):.1f} us")


def steps(worker: TransferWorker, spec: TransferSpec, samples: int) -> None:
    """Where a `submit` of `worker` spends its host time: the worker's steps and
    torch's CUDA calls, each timed inside real submits (wrapped for the measurement,
    ~0.3 us per wrapper; inclusive: `launch` holds the graph replay, which holds the
    driver call). Medians per submit, with the calls each step made."""
    from tierkv.gpu import driver_calls
    from tierkv.gpu import graphs as graphs_module
    from tierkv.gpu import streams as streams_module
    from tierkv.gpu import worker as worker_module
    from tierkv.gpu.options import Backends

    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    targets: list[tuple[Any, str, str]] = [
        (worker_module, "map_specs", "check and map the spec"),
        (streams_module.CudaStreams, "order_after", "order after ready"),
        (Backends, "pick", "pick the backend"),
        (streams_module.CudaStreams, "launch", "launch (events, copy)"),
        (graphs_module.GraphTable, "launch", "  graph slot and replay"),
        (streams_module, "_timing_event", "  new end event object"),
        (torch.cuda.Event, "record", "  torch Event.record"),
        (torch.cuda.Stream, "wait_event", "  torch Stream.wait_event"),
        (torch.cuda.Event, "query", "torch Event.query"),
        (driver_calls.DriverEvents, "record", "driver event record"),
        (driver_calls.DriverEvents, "wait", "driver stream wait"),
        (driver_calls.DriverEvents, "query", "driver event query"),
        (TransferWorker, "_reap", "reap finished transfers"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
                calls[label] = calls.get(label, 0) + 1

        return wrapper

    for owner, name, label in targets:
        setattr(owner, name, timed(label, getattr(owner, name)))
    rows: dict[str, list[float]] = {label: [] for _, _, label in targets}
    totals: list[float] = []
    counted: dict[str, int] = {}
    try:
        for i in range(samples + 20):
            torch.cuda.synchronize()
            spent.clear()
            calls.clear()
            start = time.perf_counter()
            worker.submit(spec)
            total = time.perf_counter() - start
            if i < 20:  # warm-up
                continue
            totals.append(total)
            for label in rows:
                rows[label].append(spent.get(label, 0.0))
            counted = dict(calls)
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
        worker.get_finished()
    total_us = statistics.median(totals) * 1e6
    print(f"  steps of a submit (median of {samples}; total {total_us:.1f} us)")
    for label, times in rows.items():
        print(f"    {label}: {statistics.median(times) * 1e6:.1f} us x{counted.get(label, 0)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", type=size, default=64 << 10)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument(
        "--profile", action="store_true", help="also print cProfile's top of DMA submits"
    )
    parser.add_argument("--no-large", action="store_true", help="skip the 512-block rows")
    parser.add_argument(
        "--steps", action="store_true", help="also time the steps of each backend's submit"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_one_block: no CUDA device here")
        return 0
    page, layers, samples = args.page, args.layers, args.samples
    kv = [torch.zeros(1024, page, dtype=torch.uint8, device="cuda") for _ in range(layers)]
    primary = PrimaryTier(512, layers * page, pin_memory=True)
    layout = KVLayout(block_bytes=layers * page, groups=(GroupSpec(block_size=16),))
    spec = TransferSpec("load", [torch.tensor([5])], [torch.tensor([9])], [0])
    row = primary.view.tensor[0].view(layers, page)
    print(f"one-block load, {layers} layers x {page // 1024} KiB pages, median of {samples}")
    cuda_parts(samples)
    for backend in [*COPY_BACKENDS, "bounded-nograph"]:
        worker = TransferWorker(
            [kv],
            primary.view,
            layout,
            gpu_block_size=16,
            copy_backend=backend.removesuffix("-nograph"),  # type: ignore[arg-type]
            ready=torch.cuda.current_stream(),
        )
        small = worker._backends.small
        graphs = getattr(small, "graphs", None)
        if backend.endswith("-nograph"):
            small.graphs = graphs = None  # type: ignore[union-attr]

        def submit_only(w: TransferWorker = worker) -> None:
            w.submit(spec)

        def submit_synced(w: TransferWorker = worker) -> None:
            w.submit(spec)
            torch.cuda.synchronize()

        async def awaited(w: TransferWorker = worker) -> list[float]:
            times = []
            for _ in range(samples):
                torch.cuda.synchronize()
                start = time.perf_counter()
                await w.transfer(spec)
                times.append(time.perf_counter() - start)
            return times

        alone = median_us(submit_only, samples)
        worker.get_finished()
        if args.steps:
            steps(worker, spec, samples)
        synced = median_us(submit_synced, samples)
        worker.get_finished()
        waited = statistics.median(anyio.run(awaited)) * 1e6
        copy = median_us(lambda: kv[0][:layers].copy_(row, non_blocking=True), samples)
        replayed = ""
        if graphs is not None:
            replayed = f"; graph replays {graphs.replays}, all slots busy {graphs.busy}"
        print(
            f"{backend:>6}: submit {alone:.0f} us, submit+synchronize {synced:.0f} us, "
            f"await transfer {waited:.0f} us (one contiguous copy_ of the bytes: "
            f"{copy:.0f} us){replayed}"
        )
        if args.no_large:
            worker.close()
            continue
        many = TransferSpec("load", [torch.randperm(1024)[:512]], [torch.randperm(512)], [0])
        big = median_us(functools.partial(worker.submit, many), 5)
        big_synced = median_us(functools.partial(submit_then_sync, worker, many), 5)
        worker.get_finished()
        gaps = {
            threaded: statistics.median(
                anyio.run(longest_loop_gap_us, worker, many, threaded) for _ in range(5)
            )
            for threaded in (False, True)
        }
        print(
            f"{backend:>6}: 512 blocks: longest loop stall {gaps[False]:.0f} us through "
            f"submit, {gaps[True]:.0f} us through start (submitter thread)"
        )
        if args.profile and backend == "dma":
            profile = cProfile.Profile()
            profile.runcall(median_us, submit_only, samples)
            worker.get_finished()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        print(
            f"{backend:>6}: 512 blocks: submit {big:.0f} us (the loop's share), "
            f"submit+synchronize {big_synced:.0f} us"
        )
        worker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
