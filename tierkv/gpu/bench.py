"""Measuring the GPU hop (`tierkv bench --gpu`).

Per copy backend and page size: store and load GB/s of a transfer of random GPU blocks
to random slots, next to one contiguous pinned copy of the same bytes in the same run
(the ratio is the figure that matters), and how much slower a stream of bf16 matmuls
runs while the worker copies beside it (the copy engines leave the SMs to the model;
gather/scatter kernels do not). Also the wall time of a one-block load, submit to
awaited result. Without CUDA it says so and reports the host cost of building DMA
plans, the one part of the hot path a CPU can measure.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import torch

from tierkv.contract.units import format_size
from tierkv.gpu.backends import AUTO_MIN_DMA_COPY_BYTES, CopyBackendName
from tierkv.gpu.bounded import triton_missing
from tierkv.gpu.cuda_batch import MAX_COPIES_PER_CALL
from tierkv.gpu.geometry import Geometry
from tierkv.gpu.mapping import map_specs
from tierkv.gpu.plan import GroupTable, SlabTable, build_plan
from tierkv.gpu.spec import Direction, TransferSpec
from tierkv.gpu.worker import TransferWorker
from tierkv.layout import GroupSpec, KVLayout

PAGE_SIZES = (4 << 10, 16 << 10, 64 << 10)
BACKENDS: tuple[CopyBackendName, ...] = ("kernel", "bounded", "dma")
SWEEP_PAGE = 16 << 10
SWEEP_PROGRAMS = (4, 8, 16, 32)
"""`bounded_programs` values compared at `SWEEP_PAGE` pages: the copy's speed against
the matmul slowdown, what `tierkv.gpu.bounded.DEFAULT_PROGRAMS` is chosen from."""


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class _Setup:
    """KV caches, a slab and a worker over them; random GPU blocks and slots."""

    def __init__(
        self,
        total_bytes: int,
        *,
        page_bytes: int,
        num_layers: int,
        block_size_factor: int,
        device: torch.device,
        copy_backend: CopyBackendName,
        seed: int,
        max_copies_per_call: int = MAX_COPIES_PER_CALL,
        bounded_programs: int | None = None,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        block = num_layers * page_bytes
        self.count = max(1, total_bytes // block)
        self.moved = self.count * block
        self.device = device
        self.kv = [
            torch.randint(
                0, 256, (2 * self.count, page_bytes), dtype=torch.uint8, generator=gen
            ).to(device)
            for _ in range(num_layers)
        ]
        pinned = device.type == "cuda"
        slots_total = -(-2 * self.count // block_size_factor)
        self.slab = torch.zeros(
            (slots_total, block * block_size_factor), dtype=torch.uint8, pin_memory=pinned
        )
        layout = KVLayout(
            block_bytes=block * block_size_factor,
            groups=(GroupSpec(block_size=16 * block_size_factor),),
        )
        self.ready = torch.cuda.current_stream(device) if pinned else None
        self.worker = TransferWorker(
            [self.kv],
            self.slab,
            layout,
            gpu_block_size=16,
            copy_backend=copy_backend,
            ready=self.ready,
            max_copies_per_call=max_copies_per_call,
            bounded_programs=bounded_programs,
        )
        self.gpu_ids = torch.randperm(2 * self.count, generator=gen)[: self.count]
        self.slots = torch.randperm(slots_total, generator=gen)[
            : -(-self.count // block_size_factor)
        ]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def move(self, direction: Direction, ready: Any = None) -> None:
        self.worker.submit(TransferSpec(direction, [self.gpu_ids], [self.slots], [0]), ready=ready)
        self.worker.get_finished()

    def best(self, run: Callable[[], object], repeats: int) -> float:
        times = []
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            run()
            self.sync()
            self.worker.get_finished()
            times.append(time.perf_counter() - start)
        return min(times)


def benchmark(
    total_bytes: int = 256 * 2**20,
    *,
    page_bytes: int = 32 * 2**10,
    num_layers: int = 32,
    block_size_factor: int = 1,
    repeats: int = 3,
    device: str = "cpu",
    copy_backend: CopyBackendName = "auto",
    seed: int = 0,
    max_copies_per_call: int = MAX_COPIES_PER_CALL,
    bounded_programs: int | None = None,
) -> dict[str, Any]:
    """Throughput of a store and a load of `total_bytes` (random GPU blocks to random
    slots) against a raw `copy_` of the same bytes between the same two memories,
    measured in the same run with one torch thread; best of `repeats`. `batched_calls`:
    the batched memcpy's driver calls over all of it (None where DMA is not batched)."""
    dev = torch.device(device)
    setup = _Setup(
        total_bytes,
        page_bytes=page_bytes,
        num_layers=num_layers,
        block_size_factor=block_size_factor,
        device=dev,
        copy_backend=copy_backend,
        seed=seed,
        max_copies_per_call=max_copies_per_call,
        bounded_programs=bounded_programs,
    )
    pinned = dev.type == "cuda"
    src = torch.empty(setup.moved, dtype=torch.uint8, device=dev)
    dst = torch.empty(setup.moved, dtype=torch.uint8, pin_memory=pinned)
    with _one_thread():
        raw_store = setup.best(lambda: dst.copy_(src, non_blocking=True), repeats)
        raw_load = setup.best(lambda: src.copy_(dst, non_blocking=True), repeats)
        store = setup.best(lambda: setup.move("store"), repeats)
        load = setup.best(lambda: setup.move("load"), repeats)
    stats = setup.worker.batch_stats
    setup.worker.close()
    gbps = setup.moved / 1e9
    return {
        "bytes": setup.moved,
        "device": str(dev),
        "page_bytes": page_bytes,
        "copy_backend": copy_backend,
        "store_GBps": gbps / store,
        "load_GBps": gbps / load,
        "raw_store_GBps": gbps / raw_store,
        "raw_load_GBps": gbps / raw_load,
        "store_ratio": raw_store / store,
        "load_ratio": raw_load / load,
        "batched_calls": stats.calls if stats is not None else None,
    }


def matmul_slowdown(
    setup: _Setup, direction: Direction, *, size: int = 8192, count: int = 30
) -> float:
    """CUDA only. How much longer `count` bf16 `size`^3 matmuls take on their own
    stream while the worker moves `direction` transfers beside them (0.1 = 10 %)."""
    device = setup.device
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    compute = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def matmuls() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(compute):
            start.record(compute)
            for _ in range(count):
                torch.mm(a, b)
            end.record(compute)
        return start, end

    setup.sync()
    matmuls()  # warm up
    setup.sync()
    start, end = matmuls()
    setup.sync()
    alone = start.elapsed_time(end)
    one_transfer = setup.best(lambda: setup.move(direction), 1) * 1000
    kv_ready = compute.record_event()  # the KV is ready before the matmuls start
    start, end = matmuls()
    for _ in range(max(1, int(alone / max(one_transfer, 1e-3)) + 1)):
        setup.move(direction, ready=kv_ready)
    setup.sync()
    setup.worker.get_finished()
    return float(start.elapsed_time(end) / alone - 1.0)


def one_block_load_us(setup: _Setup, samples: int = 200) -> float:
    """Median wall time of a one-block load, submit to awaited result, in us."""
    spec = TransferSpec("load", [setup.gpu_ids[:1]], [setup.slots[:1]], [0])

    async def measure() -> list[float]:
        times = []
        for _ in range(samples):
            start = time.perf_counter()
            await setup.worker.transfer(spec)
            times.append(time.perf_counter() - start)
        return times

    return statistics.median(anyio.run(measure)) * 1e6


def plan_cost(num_blocks: int = 512, num_layers: int = 32, repeats: int = 20) -> dict[str, Any]:
    """Host cost of checking a transfer and building its DMA plan (NumPy only):
    the part of a submission that runs on the event loop besides the driver call."""
    page = 64 << 10
    geometry = Geometry(
        ((page,) * num_layers,), 1, page * num_layers, (2 * num_blocks,), 2 * num_blocks
    )
    table = GroupTable.of(
        gpu_base=[(1 << 40) + layer * (1 << 32) for layer in range(num_layers)],
        gpu_stride=[page] * num_layers,
        layer_offset=geometry.layer_offsets(0),
        page=[page] * num_layers,
    )
    rng = np.random.default_rng(0)
    spec = TransferSpec(
        "store",
        [rng.permutation(2 * num_blocks)[:num_blocks]],
        [rng.permutation(2 * num_blocks)[:num_blocks]],
        [0],
    )
    slab = SlabTable(1 << 36, geometry.sub_block_stride)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build_plan(map_specs([spec], geometry), [table], slab)
        times.append(time.perf_counter() - start)
    pages = num_blocks * num_layers
    best = min(times)
    return {"pages": pages, "plan_us": best * 1e6, "plan_ns_per_page": best * 1e9 / pages}


def gpu_report(total_bytes: int, repeats: int, *, num_layers: int = 32) -> dict[str, Any]:
    """Everything `tierkv bench --gpu` prints, as data."""
    report: dict[str, Any] = {"cuda": torch.cuda.is_available(), "plan_cost": plan_cost()}
    report["auto_min_dma_copy_bytes"] = AUTO_MIN_DMA_COPY_BYTES
    if not report["cuda"]:
        report["reason"] = "no CUDA device here: nothing was copied to or from a GPU"
        return report
    report["device"] = torch.cuda.get_device_name(torch.device("cuda"))
    backends = [b for b in BACKENDS if b != "bounded" or triton_missing() is None]
    report["rows"] = [
        _measured(total_bytes, repeats, page, backend, num_layers=num_layers)
        for page in PAGE_SIZES
        for backend in backends
    ]
    report["sweep"] = (
        [
            _measured(
                total_bytes, repeats, SWEEP_PAGE, "bounded", num_layers=num_layers, programs=p
            )
            for p in SWEEP_PROGRAMS
        ]
        if "bounded" in backends
        else []
    )
    return report


def _measured(
    total_bytes: int,
    repeats: int,
    page: int,
    backend: CopyBackendName,
    *,
    num_layers: int,
    programs: int | None = None,
) -> dict[str, Any]:
    """One row of the report: throughput against the raw copy, the matmul slowdown
    beside stores and loads, and a one-block load's wall time."""
    row = benchmark(
        total_bytes,
        page_bytes=page,
        num_layers=num_layers,
        repeats=repeats,
        device="cuda",
        copy_backend=backend,
        bounded_programs=programs,
    )
    setup = _Setup(
        total_bytes,
        page_bytes=page,
        num_layers=num_layers,
        block_size_factor=1,
        device=torch.device("cuda"),
        copy_backend=backend,
        seed=1,
        bounded_programs=programs,
    )
    row["programs"] = programs if backend == "bounded" else None
    row["matmul_slowdown_store"] = matmul_slowdown(setup, "store")
    row["matmul_slowdown_load"] = matmul_slowdown(setup, "load")
    row["one_block_load_us"] = one_block_load_us(setup)
    setup.worker.close()
    return row


def format_gpu_report(report: dict[str, Any]) -> str:
    cost = report["plan_cost"]
    lines = [
        f"DMA plan on the host: {cost['pages']} pages in {cost['plan_us']:.0f} us "
        f"({cost['plan_ns_per_page']:.0f} ns/page)",
    ]
    if not report["cuda"]:
        lines.insert(0, f"tierkv bench --gpu: {report['reason']}")
        return "\n".join(lines)
    lines.insert(0, f"tierkv bench --gpu on {report['device']}")
    header = (
        f"{'page':>8} {'backend':>7} | {'store GB/s':>10} {'(ratio)':>7} | "
        f"{'load GB/s':>9} {'(ratio)':>7} | {'matmul +% st/ld':>15} | {'1-block load':>12}"
    )
    lines += [header, "-" * len(header)]
    sweep = report.get("sweep", [])
    for row in [*report["rows"], *sweep]:
        name = row["copy_backend"] if row in report["rows"] else f"b/{row['programs']}"
        lines.append(
            f"{format_size(row['page_bytes']):>8} {name:>7} | "
            f"{row['store_GBps']:>10.1f} {row['store_ratio']:>7.2f} | "
            f"{row['load_GBps']:>9.1f} {row['load_ratio']:>7.2f} | "
            f"{100 * row['matmul_slowdown_store']:>7.0f}/"
            f"{100 * row['matmul_slowdown_load']:<7.0f} | "
            f"{row['one_block_load_us']:>9.0f} us"
        )
    lines.append(
        "ratio: tierkv / one contiguous pinned copy of the same bytes, same run; "
        "auto replays transfers of 1-4 blocks on the bounded kernel's captured graphs, "
        f"others use DMA from {format_size(report['auto_min_dma_copy_bytes'])} per copy, "
        "below it the bounded kernel; b/N: the bounded kernel on N thread blocks"
    )
    return "\n".join(lines)


def run_gpu_bench(total_bytes: int, repeats: int, as_json: bool) -> int:
    """`tierkv bench --gpu`: measure, print, exit 0 (also without CUDA)."""
    report = gpu_report(total_bytes, repeats)
    text = json.dumps(report, indent=2) if as_json else format_gpu_report(report)
    sys.stdout.write(text + "\n")
    return 0
