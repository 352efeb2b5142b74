"""`cuMemcpyBatchAsync` (CUDA 12.8+) through NVIDIA's `cuda-bindings` (the optional
extra `tierkv[cuda]`): a whole copy plan in one driver call, fed straight from the
plan's NumPy arrays.

The Python wrapper `cuda.bindings.runtime.cudaMemcpyBatchAsync` builds one Python
object per pointer (about 21 ms for 16,384 pages, measured on an H100), so the entry
point is taken from the driver with `cuGetProcAddress` at a fixed ABI version and
called through `ctypes` with the arrays' addresses: no per-page Python work.

The ABI asked for is the 12.8 one (`..., numAttrs, size_t *failIdx, stream`); CUDA 13
drivers still serve it under that version number. Every copy reads its source in
stream order (`CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`): the copy must not read KV before
the `ready` the transfer waits on, so the faster "any order" setting is wrong here.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from typing import Any

import numpy as np

from tierkv.gpu.plan import CopyPlan

logger = logging.getLogger(__name__)

ABI_VERSION = 12080
SRC_ACCESS_ORDER_STREAM = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_SIGNATURE = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # size_t *failIdx
    ctypes.c_void_p,  # CUstream
)


class BatchMemcpy:
    """Enqueues a whole `CopyPlan` on a CUDA stream in one driver call."""

    def __init__(self, function: Any) -> None:
        self._function = function
        self._attrs = _MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM)
        self._first_copy = ctypes.c_size_t(0)

    def __call__(self, plan: CopyPlan, stream_handle: int) -> tuple[object, ...]:
        """Enqueue `plan` on the stream `stream_handle` (never the legacy NULL
        stream); returns the arrays to keep alive until the copy is done."""
        if not plan.count:
            return ()
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in plan_arrays(plan))
        failed_at = ctypes.c_size_t(0)
        status = self._function(
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            plan.count,
            ctypes.addressof(self._attrs),
            ctypes.addressof(self._first_copy),
            1,
            ctypes.byref(failed_at),
            stream_handle,
        )
        if status != 0:
            raise RuntimeError(
                f"cuMemcpyBatchAsync failed with CUresult {status} at copy {failed_at.value} "
                f"of {plan.count}"
            )
        return dsts, srcs, sizes


def plan_arrays(plan: CopyPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return plan.dsts, plan.srcs, plan.sizes


def load_batch_memcpy() -> BatchMemcpy | None:
    """The batched memcpy, or None where cuda-bindings or the driver entry point is
    missing (then DMA copies fall back to one `copy_` per run)."""
    try:
        driver = importlib.import_module("cuda.bindings.driver")
    except ImportError:
        logger.info("cuda-bindings is not installed (tierkv[cuda]); DMA uses copy_ per run")
        return None
    try:
        status, address, _found = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", ABI_VERSION, 0)
    except Exception as exc:  # an older cuda-bindings or driver
        logger.info("cuGetProcAddress(cuMemcpyBatchAsync) failed (%s); copy_ per run", exc)
        return None
    if status != driver.CUresult.CUDA_SUCCESS or not int(address):
        logger.info("cuMemcpyBatchAsync is unavailable (%s); DMA uses copy_ per run", status)
        return None
    return BatchMemcpy(_SIGNATURE(int(address)))
