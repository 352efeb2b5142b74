"""`cuMemcpyBatchAsync` through NVIDIA's `cuda-bindings` (the optional extra
`tierkv[cuda]`): a copy plan in a few driver calls, fed straight from the plan's
NumPy arrays.

The Python wrapper `cuda.bindings.runtime.cudaMemcpyBatchAsync` builds one Python
object per pointer (about 21 ms for 16,384 pages, measured on an H100), so the entry
point is taken from the driver with `cuGetProcAddress` at an explicit ABI version and
called through `ctypes` with the arrays' addresses: no per-page Python work.

Two ABIs exist, and calling one with the other's arguments crashes the process (SGLang
shipped that): CUDA 12.8 takes `(dsts, srcs, sizes, count, attrs, attrsIdxs,
numAttrs, size_t *failIdx, stream)`, CUDA 13.0 dropped `failIdx`: `(dsts, srcs,
sizes, count, attrs, attrsIdxs, numAttrs, stream)`. `select_entry` asks the driver
for the newest one it serves (by `cuDriverGetVersion` and the symbol status
`cuGetProcAddress` returns) and binds the matching signature; nothing else in tierkv
knows which one runs.

A plan is cut into calls of at most `max_copies_per_call` copies on the same stream:
vLLM issue 49276 reports hangs and segfaults near 52k copies in one call (CUDA 13.0,
driver 580), a 512-block load of a 64-layer model is ~65k copies, and on an H200 calls
of a few hundred copies were also the fastest (`MAX_COPIES_PER_CALL`). A call the
driver refuses is redone by the caller's fallback (one `copy_` per run) for that call
only, and counted; the next call and the next transfer use the batched path again.

Every copy reads its source in stream order (`CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`): the
copy must not read KV before the `ready` the transfer waits on, so the faster "any
order" setting is wrong here.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierkv.gpu.plan import CopyPlan

logger = logging.getLogger(__name__)

ABI_12_8 = 12080
ABI_13_0 = 13000
SRC_ACCESS_ORDER_STREAM = 1
MAX_COPIES_PER_CALL = 256
"""Copies per driver call at most. Measured on an H200 (`benchmarks/gpu_dma_calls.py`,
256 MiB of 32 layers, random blocks): smaller calls let the copy engines start while
the next call is submitted. 64 KiB pages: 0.92 of one contiguous copy at 128-256 per
call, 0.87 at 1024, 0.71 at 8192; 16 KiB loads: 0.54 at 256, 0.12 at 8192. Far under
the ~52k where vLLM 49276 saw hangs; a 100k-copy plan is ~400 calls (~2 ms of host)."""
NOT_ONE_COPY = ctypes.c_size_t(-1).value
"""The 12.8 ABI's `failIdx` when an error is not tied to one copy (SIZE_MAX)."""
_U64 = np.dtype(np.uint64).itemsize


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_COMMON = (
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
)
SIGNATURES: dict[int, Any] = {
    ABI_12_8: ctypes.CFUNCTYPE(ctypes.c_int, *_COMMON, ctypes.c_void_p, ctypes.c_void_p),
    ABI_13_0: ctypes.CFUNCTYPE(ctypes.c_int, *_COMMON, ctypes.c_void_p),
}
"""The C signature of each ABI (the 12.8 one has `size_t *failIdx` before the stream)."""


@dataclass
class BatchStats:
    calls: int = 0
    failed_calls: int = 0  # redone by the fallback
    copies: int = 0


class BatchMemcpy:
    """Enqueues a `CopyPlan` on a CUDA stream in calls of at most
    `max_copies_per_call` copies, through the entry point of ABI `abi`."""

    def __init__(
        self, function: Any, abi: int = ABI_12_8, *, max_copies_per_call: int = MAX_COPIES_PER_CALL
    ) -> None:
        if abi not in SIGNATURES:
            raise ValueError(f"unknown cuMemcpyBatchAsync ABI {abi}; known: {sorted(SIGNATURES)}")
        if max_copies_per_call < 1:
            raise ValueError(f"max_copies_per_call must be >= 1, got {max_copies_per_call}")
        self.abi = abi
        self.max_copies_per_call = max_copies_per_call
        self.stats = BatchStats()
        self._function = function
        self._attrs = _MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM)
        self._first_copy = ctypes.c_size_t(0)

    def __call__(
        self,
        plan: CopyPlan,
        stream_handle: int,
        fallback: Callable[[CopyPlan], None] | None = None,
    ) -> tuple[object, ...]:
        """Enqueue `plan` on the stream `stream_handle` (never the legacy NULL stream);
        returns the arrays to keep alive until the copies are done. A call the driver
        refuses goes to `fallback` (its copies only); without one it raises."""
        if not plan.count:
            return ()
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in plan_arrays(plan))
        step = self.max_copies_per_call
        for start in range(0, plan.count, step):
            n = min(step, plan.count - start)
            status, failed_at = self._call(dsts, srcs, sizes, start, n, stream_handle)
            self.stats.calls += 1
            self.stats.copies += n
            if status == 0:
                continue
            message = describe_failure(status, failed_at, start, n, plan.count)
            if fallback is None:
                raise RuntimeError(message)
            self.stats.failed_calls += 1
            logger.warning("%s; this call's copies are redone with one copy_ per run", message)
            end = start + n
            # copies are idempotent (the same bytes to the same places): a call the
            # driver partly enqueued is safely redone
            fallback(CopyPlan(dsts[start:end], srcs[start:end], sizes[start:end]))
        return dsts, srcs, sizes

    def _call(
        self,
        dsts: np.ndarray,
        srcs: np.ndarray,
        sizes: np.ndarray,
        start: int,
        n: int,
        stream_handle: int,
    ) -> tuple[int, int | None]:
        offset = start * _U64
        common = (
            dsts.ctypes.data + offset,
            srcs.ctypes.data + offset,
            sizes.ctypes.data + offset,
            n,
            ctypes.addressof(self._attrs),
            ctypes.addressof(self._first_copy),
            1,
        )
        if self.abi == ABI_13_0:
            return int(self._function(*common, stream_handle)), None
        failed_at = ctypes.c_size_t(0)
        status = int(self._function(*common, ctypes.byref(failed_at), stream_handle))
        return status, failed_at.value


def describe_failure(status: int, failed_at: int | None, start: int, n: int, total: int) -> str:
    """One readable line for a refused call (the 13.0 ABI names no copy; the 12.8 one
    may say SIZE_MAX: not tied to one copy)."""
    where = f"copies {start}..{start + n - 1} of {total}"
    if failed_at is not None and failed_at != NOT_ONE_COPY:
        where += f", first failing copy {start + failed_at}"
    return f"cuMemcpyBatchAsync failed with CUresult {status} ({where})"


def plan_arrays(plan: CopyPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return plan.dsts, plan.srcs, plan.sizes


def select_entry(driver: Any) -> tuple[Any, int] | None:
    """(function, ABI) of the newest `cuMemcpyBatchAsync` the driver serves, bound to
    that ABI's signature; None where the driver has neither. `driver` is
    `cuda.bindings.driver` (or anything with its `cuDriverGetVersion`,
    `cuGetProcAddress`, `CUresult` and `CUdriverProcAddressQueryResult`)."""
    status, version = driver.cuDriverGetVersion()
    if status != driver.CUresult.CUDA_SUCCESS:
        logger.info("cuDriverGetVersion failed (%s); DMA uses copy_ per run", status)
        return None
    found_ok = driver.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS
    for abi in (ABI_13_0, ABI_12_8):
        if int(version) < abi:
            continue
        status, address, found = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", abi, 0)
        if status == driver.CUresult.CUDA_SUCCESS and found == found_ok and int(address):
            logger.info("cuMemcpyBatchAsync: driver %s, ABI %s", version, abi)
            return SIGNATURES[abi](int(address)), abi
        logger.info("cuMemcpyBatchAsync at ABI %s: %s, %s", abi, status, found)
    return None


def load_batch_memcpy(max_copies_per_call: int = MAX_COPIES_PER_CALL) -> BatchMemcpy | None:
    """The batched memcpy, or None where cuda-bindings or the driver entry point is
    missing (then DMA copies fall back to one `copy_` per run)."""
    try:
        driver = importlib.import_module("cuda.bindings.driver")
    except ImportError:
        logger.info("cuda-bindings is not installed (tierkv[cuda]); DMA uses copy_ per run")
        return None
    try:
        entry = select_entry(driver)
    except Exception as exc:  # an older cuda-bindings or driver
        logger.info("cuMemcpyBatchAsync lookup failed (%s); copy_ per run", exc)
        return None
    if entry is None:
        return None
    function, abi = entry
    return BatchMemcpy(function, abi, max_copies_per_call=max_copies_per_call)
