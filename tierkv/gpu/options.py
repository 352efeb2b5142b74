"""What a `TransferWorker` is built from: its options, checked, and the copy backends
they ask for.

`WorkerOptions` refuses a bad option with a `ConfigError` naming it, before the
worker looks at the KV caches or touches the device. `Backends` holds the copy
backends one worker has (`tierkv.gpu.backends`: the kernel copy, DMA, or both under
`copy_backend='auto'` on CUDA) and picks the one that moves a given transfer. Kept
apart from the worker so that `worker.py` reads as submission and completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierkv.contract.errors import ConfigError
from tierkv.gpu.alias import DeviceView, device_alias
from tierkv.gpu.backends import (
    AUTO_MIN_DMA_COPY_BYTES,
    COPY_BACKENDS,
    DMA_EXECUTORS,
    CopyBackend,
    CopyBackendName,
    DmaCopy,
    DmaExecutorName,
    KernelCopy,
)
from tierkv.gpu.bounded import BoundedKernelCopy, triton_missing
from tierkv.gpu.cuda_batch import BatchStats, load_batch_memcpy
from tierkv.gpu.geometry import Geometry
from tierkv.gpu.mapping import Mapping
from tierkv.gpu.plan import CopyPlan


@dataclass(frozen=True)
class WorkerOptions:
    """The options of `TransferWorker` that choose how bytes move (its docstring says
    what each does). Made, they are valid: the first bad one raises `ConfigError`, in
    this order: copies per call, submitter threshold, copy backend, DMA executor."""

    copy_backend: CopyBackendName
    dma_executor: DmaExecutorName
    device_view: DeviceView
    max_copies_per_call: int
    thread_min_pages: int
    bounded_programs: int | None = None
    completion_poll_us: float = 200.0

    def __post_init__(self) -> None:
        check_options(
            self.copy_backend, self.dma_executor, self.max_copies_per_call, self.thread_min_pages
        )
        poll = self.completion_poll_us
        if (
            not isinstance(poll, (int, float))
            or isinstance(poll, bool)
            or not 0 <= poll < float("inf")
        ):
            raise ConfigError(
                f"completion_poll_us: {poll!r} must be a number of microseconds >= 0 "
                "(0: a waiter sleeps until the completion thread wakes it)",
                source="TransferWorker",
            )
        if self.bounded_programs is not None and not _positive_int(self.bounded_programs):
            raise ConfigError(
                f"bounded_programs: {self.bounded_programs!r} must be a positive int "
                "(thread blocks of the bounded copy kernel)",
                source="TransferWorker",
            )


def check_options(
    copy_backend: CopyBackendName,
    dma_executor: DmaExecutorName,
    max_copies_per_call: int,
    thread_min_pages: int,
) -> None:
    """Raise `ConfigError` for the first bad option (in `WorkerOptions`' order)."""
    if not _positive_int(max_copies_per_call):
        raise ConfigError(
            f"max_copies_per_call: {max_copies_per_call!r} must be a positive int",
            source="TransferWorker",
        )
    if (
        not isinstance(thread_min_pages, int)
        or isinstance(thread_min_pages, bool)
        or thread_min_pages < 0
    ):
        raise ConfigError(
            f"thread_min_pages: {thread_min_pages!r} must be an int >= 0",
            source="TransferWorker",
        )
    if copy_backend not in COPY_BACKENDS:
        raise ConfigError(
            f"copy_backend: {copy_backend!r} is not one of {', '.join(COPY_BACKENDS)}",
            source="TransferWorker",
        )
    if dma_executor not in DMA_EXECUTORS:
        raise ConfigError(
            f"dma_executor: {dma_executor!r} is not one of {', '.join(DMA_EXECUTORS)}",
            source="TransferWorker",
        )


def choose_backends(
    copy_backend: CopyBackendName, cuda: bool, pages: Sequence[int], triton: bool
) -> tuple[str | None, bool]:
    """(the backend for small copies or None, whether DMA is built) for a worker whose
    pages are `pages`: `auto` on CPU is the kernel copy; on CUDA it is DMA plus, with
    `triton`, the bounded kernel (whatever the pages: it replays the transfers of a few
    blocks from captured graphs, `tierkv.gpu.graphs`); without Triton, DMA plus the
    full kernel when a page is under `AUTO_MIN_DMA_COPY_BYTES`, since only then can a
    transfer's mean copy be small."""
    if copy_backend != "auto":
        return (None, True) if copy_backend == "dma" else (copy_backend, False)
    if not cuda:
        return "kernel", False
    if triton:
        return "bounded", True
    if min(pages) >= AUTO_MIN_DMA_COPY_BYTES:
        return None, True
    return "kernel", True


def _all_pages(geometry: Geometry) -> list[int]:
    return [page for pages in geometry.page_bytes for page in pages]


def _alias(slab: torch.Tensor, device: torch.device, options: WorkerOptions) -> torch.Tensor:
    """What kernels address: the slab on the CPU device, its device alias on CUDA."""
    if device.type != "cuda":
        return slab
    return device_alias(slab, device, options.device_view)


def _bounded(
    groups: Sequence[Sequence[torch.Tensor]],
    slab: torch.Tensor,
    geometry: Geometry,
    device: torch.device,
    options: WorkerOptions,
) -> BoundedKernelCopy:
    missing = triton_missing()
    if missing is not None:
        raise ConfigError(
            f"copy_backend: 'bounded' cannot run here: {missing}; use 'auto', 'dma' or 'kernel'",
            source="TransferWorker",
        )
    bounded = BoundedKernelCopy(
        groups, _alias(slab, device, options), geometry, programs=options.bounded_programs
    )
    if device.type == "cuda":
        bounded.warm_up()
        bounded.capture_small()
    return bounded


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Backends:
    """The copy backends of one worker: DMA for large copies and one backend for
    small ones (`bounded` or `kernel`), either alone or both (`auto` on CUDA, where
    `pick` chooses per transfer). At least one is set."""

    small: BoundedKernelCopy | KernelCopy | None
    dma: DmaCopy | None

    @classmethod
    def build(
        cls,
        groups: Sequence[Sequence[torch.Tensor]],
        slab: torch.Tensor,
        geometry: Geometry,
        device: torch.device,
        options: WorkerOptions,
    ) -> Backends:
        """The backends `options.copy_backend` asks for on `device`. `auto` on the CPU
        device is the kernel copy alone; on CUDA it is DMA, plus `bounded` (or `kernel`
        without Triton) when some page is smaller than `AUTO_MIN_DMA_COPY_BYTES`. A
        backend that cannot run here is a `ConfigError` naming what is missing."""
        cuda = device.type == "cuda"
        small_name, with_dma = choose_backends(
            options.copy_backend, cuda, _all_pages(geometry), triton_missing() is None
        )
        small: BoundedKernelCopy | KernelCopy | None = None
        if small_name == "bounded":
            small = _bounded(groups, slab, geometry, device, options)
        elif small_name == "kernel":
            small = KernelCopy(groups, _alias(slab, device, options), geometry)
        dma: DmaCopy | None = None
        if with_dma:
            try:
                dma = DmaCopy(
                    groups,
                    slab,
                    geometry,
                    executor=options.dma_executor,
                    batch=load_batch_memcpy(options.max_copies_per_call) if cuda else None,
                )
            except ValueError as exc:
                raise ConfigError(f"dma_executor: {exc}", source="TransferWorker") from None
        return cls(small, dma)

    def pick(self, mapping: Mapping) -> tuple[CopyBackend, CopyPlan | None]:
        """The backend that moves `mapping`, and the DMA plan when one was made to
        decide (the chosen DMA backend reuses it). Under `auto` on CUDA: a transfer
        the bounded kernel replays from a captured graph goes to it (its host cost is
        a fraction of the batched memcpy's), any other by the size of its copies."""
        if self.dma is None:
            assert self.small is not None
            return self.small, None
        if self.small is None:
            return self.dma, None
        if isinstance(self.small, BoundedKernelCopy) and self.small.replays(mapping):
            return self.small, None
        plan = self.dma.plan(mapping)  # auto on CUDA: by the size of the copies
        if plan.mean_copy_bytes >= AUTO_MIN_DMA_COPY_BYTES:
            return self.dma, plan
        return self.small, None

    @property
    def batch_stats(self) -> BatchStats | None:
        return self.dma.batch_stats if self.dma is not None else None

    @property
    def dma_executor(self) -> str | None:
        return self.dma.executor if self.dma is not None else None
