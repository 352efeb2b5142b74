"""CUDA driver entry points called through `ctypes`, for a small transfer's host path.

Why: a one-block load makes a handful of event and stream calls (order after `ready`,
record the start and end events, look whether the copy is done). Through torch each
costs 1.2-2.5 us of host time on an H100 (argument parsing, a device guard, the
runtime's wrapper: `benchmarks/gpu_one_block.py --steps`), a third of a one-block
submit; the driver's own call through `ctypes` costs a fraction of that.

Only events torch has already created are handed to the driver: torch creates an event
at its first `record` and answers `query` for an event it never created with True, so
an event whose handle is still 0 goes through torch (`DriverEvents.record`, `.query`).
The driver's calls take the event's and stream's handles, which torch exposes
(`Event.cuda_event`, `Stream.cuda_stream`). Entry points come from `cuGetProcAddress`
at the ABI they have had since CUDA 10.0; where cuda-bindings or an entry point is
missing, `load_driver_events` returns None and the caller keeps torch's calls.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

ABI_CUDA_10 = 10000
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600

_HANDLES_2 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_HANDLE_1 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)

Record = Callable[[int, int], int]
"""`cuEventRecord(event, stream) -> CUresult`."""
Query = Callable[[int], int]
"""`cuEventQuery(event) -> CUresult` (0 done, 600 not yet)."""
Wait = Callable[[int, int, int], int]
"""`cuStreamWaitEvent(stream, event, flags) -> CUresult`."""


def driver_entry(name: str, signature: Any, abi: int = ABI_CUDA_10) -> Any | None:
    """The driver's `name` at `abi` as a `ctypes` function of `signature`, or None
    (logged) where cuda-bindings, the driver or the entry point is missing."""
    try:
        driver = importlib.import_module("cuda.bindings.driver")
        status, address, found = driver.cuGetProcAddress(name.encode(), abi, 0)
    except Exception as exc:  # no cuda-bindings, or an older one
        logger.info("%s lookup failed (%s)", name, exc)
        return None
    ok = driver.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS
    if status != driver.CUresult.CUDA_SUCCESS or found != ok or not int(address):
        logger.info("%s not served (%s, %s)", name, status, found)
        return None
    return signature(int(address))


class DriverEvents:
    """Record, query and wait on torch's CUDA events through the driver (see the
    module doc); an event torch has not created yet goes through torch."""

    def __init__(self, record: Record, query: Query, wait: Wait) -> None:
        self._record = record
        self._query = query
        self._wait = wait

    def record(self, event: Any, stream: Any) -> None:
        handle = event.cuda_event
        if not handle:  # torch creates it at its first record
            event.record(stream)
            return
        _check(self._record(handle, stream.cuda_stream), "cuEventRecord")

    def query(self, event: Any) -> bool:
        handle = event.cuda_event
        if not handle:
            return True  # never recorded: nothing to wait for (torch says the same)
        status = self._query(handle)
        if status == CUDA_SUCCESS:
            return True
        if status == CUDA_ERROR_NOT_READY:
            return False
        raise RuntimeError(f"cuEventQuery failed with CUresult {status}")

    def wait(self, stream: Any, event: Any) -> None:
        """Make work queued later on `stream` wait for `event`'s latest record (a
        torch event; one never recorded orders nothing, as with torch)."""
        handle = event.cuda_event
        if handle:
            _check(self._wait(stream.cuda_stream, handle, 0), "cuStreamWaitEvent")


def _check(status: int, call: str) -> None:
    if status != CUDA_SUCCESS:
        raise RuntimeError(f"{call} failed with CUresult {status}")


def load_driver_events() -> DriverEvents | None:
    """`DriverEvents` over the driver's entry points, or None where one is missing
    (the caller then uses torch's event calls)."""
    record = driver_entry("cuEventRecord", _HANDLES_2)
    query = driver_entry("cuEventQuery", _HANDLE_1)
    wait = driver_entry("cuStreamWaitEvent", _WAIT)
    if record is None or query is None or wait is None:
        return None
    return DriverEvents(record, query, wait)
