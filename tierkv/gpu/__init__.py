"""The GPU hop: moving KV blocks between the engine's GPU KV caches and the primary
slab.

One idea per module: `spec` (what a transfer asks), `geometry` (where each page lives
in a slab row, and the layout checks), `mapping` (a spec checked and mapped to slab
sub-rows), `plan` (the DMA copy triples, plain NumPy arithmetic), `backends` (DMA and
kernel copies), `executors` / `cuda_batch` (how DMA triples are applied), `alias` (the
slab's device alias), `streams` (ordering and events), `lanes` (transfers in flight,
completion threads), `options` (a worker's options checked, its copy backends built),
`worker` (`TransferWorker`), `bench` (`tierkv bench --gpu`).
"""

from __future__ import annotations

from tierkv.gpu.backends import AUTO_MIN_DMA_COPY_BYTES, COPY_BACKENDS
from tierkv.gpu.geometry import page_bytes_of, required_block_bytes
from tierkv.gpu.lanes import TransferHandle
from tierkv.gpu.spec import (
    DIRECTIONS,
    BlockIds,
    Direction,
    TransferResult,
    TransferSpec,
    TransferSpecError,
)
from tierkv.gpu.worker import TransferWorker

__all__ = [
    "AUTO_MIN_DMA_COPY_BYTES",
    "COPY_BACKENDS",
    "DIRECTIONS",
    "BlockIds",
    "Direction",
    "TransferHandle",
    "TransferResult",
    "TransferSpec",
    "TransferSpecError",
    "TransferWorker",
    "page_bytes_of",
    "required_block_bytes",
]
