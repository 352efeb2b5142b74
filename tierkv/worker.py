"""Compatibility path: the transfer worker lives in `tierkv.gpu` now.

Kept because code outside the GPU package (the demo engine, examples, engines that
embed tierkv) imports `tierkv.worker`; new code imports from `tierkv` or `tierkv.gpu`.
`benchmark` moved to `tierkv.gpu.bench`.
"""

from __future__ import annotations

from tierkv.gpu.alias import uva_view
from tierkv.gpu.geometry import page_bytes_of, required_block_bytes
from tierkv.gpu.spec import (
    DIRECTIONS,
    BlockIds,
    Direction,
    TransferResult,
    TransferSpec,
    TransferSpecError,
)
from tierkv.gpu.worker import TransferHandle, TransferWorker

__all__ = [
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
    "uva_view",
]
