"""The `bounded` copy backend: the Triton page-copy kernel of
`tierkv.gpu.triton_pages` on a fixed grid of `programs` thread blocks, so that small
pages move at the link's speed without taking the model's SMs (see that module).

Per group the worker uploads, once, each layer's GPU base and stride, the slab alias's
per-layer address and the page length in words. A transfer then writes its block ids
and slab rows into one small host buffer (pinned on CUDA, read by the kernel over the
bus) and launches the kernel once per group that moves blocks. The buffer stays alive
until the transfer's completion is reaped (it travels in the launch's keep-alive).

Transfers of a few blocks per group are replayed from captured CUDA graphs
(`tierkv.gpu.graphs`, set up by `capture_small`): the host writes the ids into the
captured buffer and makes one driver call, instead of a Triton launch, a stream
context and a pinned allocation.

Needs Triton. On CUDA the kernel is compiled (at construction, so no transfer waits
for the compiler); on the CPU device it runs under Triton's interpreter, slowly: that
is how the CPU tests prove its address arithmetic byte for byte.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tierkv.gpu.geometry import Geometry
from tierkv.gpu.graphs import GRAPH_MAX_BLOCKS, GRAPH_SLOTS, GraphTable, capture_graphs
from tierkv.gpu.mapping import Mapping
from tierkv.gpu.plan import CopyPlan
from tierkv.gpu.spec import Direction

DEFAULT_PROGRAMS: dict[Direction, int] = {"store": 8, "load": 32}
"""Thread blocks the kernel runs on, per direction (an H100 has 132 SMs). Stores write
over the bus (posted writes: few blocks keep the link busy); loads read over it and
need more reads in flight. Measured on an H100 at 16 KiB pages
(`benchmarks/gpu_bounded_sweep.py`, `tierkv bench --gpu`; noisy, three runs): stores on
8 blocks moved 0.79-0.86 of a contiguous copy with matmuls beside them 5-12 % slower
(16 blocks: 0.80-0.84 at 10-23 %); loads on 32 blocks 0.84-0.87 at 0-7 % (8 blocks:
0.60-0.64). `TransferWorker(..., bounded_programs=N)` uses N both ways."""

_WORDS = (8, 4, 2, 1)
Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""Per layer of a group, on the device: GPU base, GPU stride, slab address, words."""


def triton_missing() -> str | None:
    """Why the bounded backend cannot run here (None when it can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (torch's CUDA wheels bring it: pip install triton)"
    return None


def _word(values: Sequence[int]) -> int:
    for size in _WORDS:
        if all(v % size == 0 for v in values):
            return size
    return 1


def _address(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr()) + int(t.storage_offset()) * t.element_size()


class BoundedKernelCopy:
    """Pages moved by the bounded Triton kernel; see the module doc."""

    name = "bounded"

    def __init__(
        self,
        groups: Sequence[Sequence[torch.Tensor]],
        slab: torch.Tensor,
        geometry: Geometry,
        *,
        programs: int | None = None,
    ) -> None:
        """`slab` is the slab's device alias on CUDA (the slab itself on CPU under the
        interpreter); `programs` the kernel's grid in both directions (default:
        `DEFAULT_PROGRAMS` per direction)."""
        from tierkv.gpu import triton_pages  # Triton, only when this backend is used

        self._launch = triton_pages.launch
        self.programs: dict[Direction, int] = (
            dict(DEFAULT_PROGRAMS) if programs is None else {"store": programs, "load": programs}
        )
        self._device = slab.device
        self._cuda = slab.device.type == "cuda"
        self.graphs: GraphTable | None = None
        self._sub_block_stride = geometry.sub_block_stride
        # the kernel reaches the KV caches and the slab by raw address: keep them alive
        # with the backend (the DMA and kernel backends hold theirs through views)
        self._addressed = (tuple(tuple(layers) for layers in groups), slab)
        base = _address(slab)
        self._tables: list[tuple[Tables, int, int]] = []
        for g, layers in enumerate(groups):
            gpu_base = [_address(t) for t in layers]
            gpu_stride = [int(t.stride(0)) * t.element_size() for t in layers]
            slab_layer = [base + offset for offset in geometry.layer_offsets(g)]
            pages = list(geometry.page_bytes[g])
            word = _word([*gpu_base, *gpu_stride, *slab_layer, *pages, self._sub_block_stride])
            columns = (gpu_base, gpu_stride, slab_layer, [p // word for p in pages])
            a, b, c, d = (torch.tensor(c, dtype=torch.int64).to(self._device) for c in columns)
            self._tables.append(((a, b, c, d), len(layers), word))

    @property
    def uses_current_stream(self) -> bool:
        """Triton launches on torch's current stream; with captured graphs the
        backend is handed the stream and enters its context only for the launches
        no graph covers."""
        return self.graphs is None

    def replays(self, mapping: Mapping) -> bool:
        """Whether every group of `mapping` has a captured graph of its size (it is
        replayed unless all of that size's slots are still in flight)."""
        if self.graphs is None:
            return False
        store = mapping.direction == "store"
        return all(
            not ids.size or self.graphs.covers(g, store, int(ids.size))
            for g, ids in enumerate(mapping.gpu)
        )

    def capture_small(self, max_blocks: int = GRAPH_MAX_BLOCKS, slots: int = GRAPH_SLOTS) -> None:
        """CUDA, after `warm_up`: capture the launches of 1..`max_blocks` blocks per
        group, `slots` of each size (`tierkv.gpu.graphs`). Where capturing fails,
        every transfer keeps launching the kernel directly (logged)."""
        if not self._cuda or max_blocks < 1:
            return
        self.graphs = capture_graphs(
            self._capture, len(self._tables), self._device, max_blocks=max_blocks, slots=slots
        )

    def _capture(self, ids_addr: int, n: int, group: int, store: bool) -> None:
        tables, num_layers, word = self._tables[group]
        self._launch(
            self.programs["store" if store else "load"],
            ids_addr,
            n,
            tables,
            num_layers,
            self._sub_block_stride,
            store=store,
            word=word,
            interpret=not self._cuda,  # CPU: the tests' stand-in for a captured launch
        )

    def _staged(self, ids: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """Block ids then rows, in host memory the kernel can read (pinned on CUDA)."""
        n = ids.size
        staged = torch.empty(2 * n, dtype=torch.int64, pin_memory=self._cuda)
        view = staged.numpy()
        view[:n] = ids
        view[n:] = rows
        return staged

    def enqueue(self, mapping: Mapping, stream: Any, plan: CopyPlan | None) -> tuple[object, ...]:
        keep: list[object] = []
        store = mapping.direction == "store"
        graphs = self.graphs
        for g, ((tables, num_layers, word), ids, rows) in enumerate(
            zip(self._tables, mapping.gpu, mapping.rows)
        ):
            if not ids.size:
                continue
            if graphs is not None:
                slot = graphs.launch(g, store, ids, rows, stream)
                if slot is not None:
                    keep.append(slot)  # the worker hands it the transfer's completion
                    continue
                with torch.cuda.stream(stream):  # Triton launches on the current stream
                    keep.append(self._launch_staged(ids, rows, tables, num_layers, word, store))
                continue
            keep.append(self._launch_staged(ids, rows, tables, num_layers, word, store))
        return tuple(keep)

    def _launch_staged(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        tables: Tables,
        num_layers: int,
        word: int,
        store: bool,
    ) -> torch.Tensor:
        """One launch over a new pinned buffer of `ids` and `rows` (returned: it must
        stay alive until the copy is done)."""
        staged = self._staged(ids, rows)
        self._launch(
            self.programs["store" if store else "load"],
            staged.data_ptr(),
            int(ids.size),
            tables,
            num_layers,
            self._sub_block_stride,
            store=store,
            word=word,
            interpret=not self._cuda,
        )
        return staged

    def warm_up(self) -> None:
        """Compile the kernel for both directions and every word size in use (CUDA),
        by launching it over no blocks: Triton compiles at the first launch, seconds
        that must not fall on the first transfer of a serving engine."""
        # a real buffer: its address is 64-bit like every transfer's (an int's width is
        # part of what Triton compiles for)
        staged = self._staged(np.zeros(1, np.int64), np.zeros(1, np.int64))
        for tables, num_layers, word in self._tables:
            for store in (True, False):
                self._launch(
                    self.programs["store" if store else "load"],
                    staged.data_ptr(),
                    0,
                    tables,
                    num_layers,
                    self._sub_block_stride,
                    store=store,
                    word=word,
                    interpret=not self._cuda,
                )
