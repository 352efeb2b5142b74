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

    def __post_init__(self) -> None:
        check_options(
            self.copy_backend, self.dma_executor, self.max_copies_per_call, self.thread_min_pages
        )


def check_options(
    copy_backend: CopyBackendName,
    dma_executor: DmaExecutorName,
    max_copies_per_call: int,
    thread_min_pages: int,
) -> None:
    """Raise `ConfigError` for the first bad option (in `WorkerOptions`' order)."""
    if isinstance(max_copies_per_call, bool) or max_copies_per_call < 1:
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


@dataclass(frozen=True)
class Backends:
    """The copy backends of one worker: `kernel`, `dma`, or both (`auto` on CUDA,
    where `pick` chooses per transfer). At least one is set."""

    kernel: KernelCopy | None
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
        """The backends `options.copy_backend` asks for on `device`: the kernel copy
        for `kernel` and `auto`, DMA for `dma` and for `auto` on CUDA (on the CPU
        device `auto` is the kernel copy alone). An executor DMA cannot use is a
        `ConfigError`."""
        cuda = device.type == "cuda"
        copy_backend = options.copy_backend
        kernel: KernelCopy | None = None
        dma: DmaCopy | None = None
        if copy_backend in ("auto", "kernel"):
            # CUDA only: kernels reach the pinned slab through its device alias
            alias = device_alias(slab, device, options.device_view) if cuda else slab
            kernel = KernelCopy(groups, alias, geometry)
        if copy_backend == "dma" or (copy_backend == "auto" and cuda):
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
        return cls(kernel, dma)

    def pick(self, mapping: Mapping) -> tuple[CopyBackend, CopyPlan | None]:
        """The backend that moves `mapping`, and the DMA plan when one was made to
        decide (the chosen DMA backend reuses it)."""
        if self.dma is None:
            assert self.kernel is not None
            return self.kernel, None
        if self.kernel is None:
            return self.dma, None
        plan = self.dma.plan(mapping)  # auto on CUDA: by the size of the copies
        if plan.mean_copy_bytes >= AUTO_MIN_DMA_COPY_BYTES:
            return self.dma, plan
        return self.kernel, None

    @property
    def batch_stats(self) -> BatchStats | None:
        return self.dma.batch_stats if self.dma is not None else None

    @property
    def dma_executor(self) -> str | None:
        return self.dma.executor if self.dma is not None else None
