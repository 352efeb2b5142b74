"""`cuda_batch`: both `cuMemcpyBatchAsync` ABIs, bounded calls and the per-call
fallback, on CPU. A ctypes callback stands in for the driver function: it checks every
argument it gets and performs the copies with `memmove`, so the bytes prove the
arithmetic (a call given the other ABI's arguments would read garbage and fail)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tierkv.gpu.cuda_batch import (
    ABI_12_8,
    ABI_13_0,
    NOT_ONE_COPY,
    SIGNATURES,
    SRC_ACCESS_ORDER_STREAM,
    BatchMemcpy,
    _MemcpyAttributes,
    select_entry,
)
from tierkv.gpu.plan import CopyPlan

STREAM = 0x5EED


@dataclass
class FakeDriver:
    """The driver function of one ABI: records each call, copies, fails on demand."""

    abi: int
    fail_calls: set[int] = field(default_factory=set)  # call numbers to refuse
    fail_index: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)

    def function(self) -> Any:
        if self.abi == ABI_12_8:

            def entry(dsts, srcs, sizes, count, attrs, idxs, nattrs, fail_idx, stream):  # type: ignore[no-untyped-def]
                return self._call(dsts, srcs, sizes, count, attrs, idxs, nattrs, fail_idx, stream)

        else:

            def entry(dsts, srcs, sizes, count, attrs, idxs, nattrs, stream):  # type: ignore[no-untyped-def]
                return self._call(dsts, srcs, sizes, count, attrs, idxs, nattrs, None, stream)

        self._keep = SIGNATURES[self.abi](entry)
        return self._keep

    def _call(self, dsts, srcs, sizes, count, attrs, idxs, nattrs, fail_idx, stream) -> int:  # type: ignore[no-untyped-def]
        attr = _MemcpyAttributes.from_address(attrs)
        call = {
            "count": count,
            "stream": stream,
            "nattrs": nattrs,
            "attr_index": ctypes.c_size_t.from_address(idxs).value,
            "order": attr.srcAccessOrder,
            "has_fail_idx": fail_idx is not None,
        }
        self.calls.append(call)
        if len(self.calls) - 1 in self.fail_calls:
            if fail_idx is not None:
                ctypes.c_size_t.from_address(fail_idx).value = self.fail_index
            return 1  # CUDA_ERROR_INVALID_VALUE
        d = (ctypes.c_uint64 * count).from_address(dsts)
        s = (ctypes.c_uint64 * count).from_address(srcs)
        n = (ctypes.c_uint64 * count).from_address(sizes)
        for i in range(count):
            ctypes.memmove(d[i], s[i], n[i])
        return 0


def scattered_plan(copies: int, size: int = 8) -> tuple[CopyPlan, bytearray, bytearray, Any]:
    """`copies` copies of `size` bytes from a source buffer to a destination buffer,
    in a shuffled order."""
    rng = np.random.default_rng(copies)
    src = bytearray(rng.integers(0, 256, copies * size, dtype=np.uint8).tobytes())
    dst = bytearray(copies * size)
    src_c = (ctypes.c_char * len(src)).from_buffer(src)
    dst_c = (ctypes.c_char * len(dst)).from_buffer(dst)
    order = rng.permutation(copies).astype(np.uint64)
    base_s, base_d = ctypes.addressof(src_c), ctypes.addressof(dst_c)
    plan = CopyPlan(
        dsts=np.uint64(base_d) + order * np.uint64(size),
        srcs=np.uint64(base_s) + order * np.uint64(size),
        sizes=np.full(copies, size, dtype=np.uint64),
    )
    return plan, src, dst, (src_c, dst_c)


@pytest.mark.parametrize("abi", [ABI_12_8, ABI_13_0])
def test_each_abi_gets_its_own_arguments_and_the_bytes_arrive(abi: int) -> None:
    driver = FakeDriver(abi)
    plan, src, dst, _keep = scattered_plan(1000)
    batch = BatchMemcpy(driver.function(), abi, max_copies_per_call=300)
    batch(plan, STREAM)
    assert dst == src
    assert [c["count"] for c in driver.calls] == [300, 300, 300, 100]
    for call in driver.calls:
        assert call["stream"] == STREAM
        assert (call["nattrs"], call["attr_index"]) == (1, 0)
        assert call["order"] == SRC_ACCESS_ORDER_STREAM
        assert call["has_fail_idx"] is (abi == ABI_12_8)
    assert (batch.stats.calls, batch.stats.copies, batch.stats.failed_calls) == (4, 1000, 0)


def test_a_plan_of_100k_copies_goes_in_bounded_calls() -> None:
    driver = FakeDriver(ABI_13_0)
    plan, src, dst, _keep = scattered_plan(100_000, size=4)
    batch = BatchMemcpy(driver.function(), ABI_13_0)
    batch(plan, STREAM)
    assert dst == src
    assert max(c["count"] for c in driver.calls) == batch.max_copies_per_call
    assert len(driver.calls) == -(-100_000 // batch.max_copies_per_call)


@pytest.mark.parametrize("abi", [ABI_12_8, ABI_13_0])
def test_a_refused_call_is_redone_by_the_fallback_for_its_copies_only(abi: int) -> None:
    driver = FakeDriver(abi, fail_calls={1}, fail_index=7)
    plan, src, dst, _keep = scattered_plan(900)
    redone: list[int] = []

    def by_runs(part: CopyPlan) -> None:
        redone.append(part.count)
        for d, s, n in zip(part.dsts.tolist(), part.srcs.tolist(), part.sizes.tolist()):
            ctypes.memmove(d, s, n)

    batch = BatchMemcpy(driver.function(), abi, max_copies_per_call=300)
    batch(plan, STREAM, by_runs)
    assert dst == src
    assert redone == [300]  # the second call's copies, nothing else
    assert batch.stats.failed_calls == 1
    driver.calls.clear()
    driver.fail_calls = set()  # the driver recovered
    plan2, src2, dst2, _keep2 = scattered_plan(600)
    batch(plan2, STREAM, by_runs)  # the next transfer is batched again
    assert dst2 == src2 and len(driver.calls) == 2 and redone == [300]


@pytest.mark.parametrize(
    ("abi", "fail_index", "expected"),
    [
        (ABI_12_8, 7, "copies 300..599 of 900, first failing copy 307"),
        (ABI_12_8, NOT_ONE_COPY, "copies 300..599 of 900)"),
        (ABI_13_0, 0, "copies 300..599 of 900)"),
    ],
)
def test_a_refused_call_without_fallback_raises_a_readable_error(
    abi: int, fail_index: int, expected: str
) -> None:
    driver = FakeDriver(abi, fail_calls={1}, fail_index=fail_index)
    plan, _src, _dst, _keep = scattered_plan(900)
    batch = BatchMemcpy(driver.function(), abi, max_copies_per_call=300)
    with pytest.raises(RuntimeError) as raised:
        batch(plan, STREAM)
    assert "CUresult 1" in str(raised.value) and expected in str(raised.value)
    assert "18446744073709551615" not in str(raised.value)


def _driver_module(version: int, served: dict[int, bool]) -> Any:
    """A stand-in for `cuda.bindings.driver`: the version, and which ABIs the symbol
    lookup finds."""
    results = SimpleNamespace(
        CU_GET_PROC_ADDRESS_SUCCESS="found", CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT="old"
    )
    fakes = {abi: FakeDriver(abi) for abi in served}
    functions = {abi: fake.function() for abi, fake in fakes.items()}
    asked: list[int] = []

    def get_proc_address(symbol: bytes, abi: int, flags: int) -> tuple[str, int, str]:
        assert symbol == b"cuMemcpyBatchAsync" and flags == 0
        asked.append(abi)
        if not served.get(abi):
            return "ok", 0, "old"
        return "ok", ctypes.cast(functions[abi], ctypes.c_void_p).value or 0, "found"

    return SimpleNamespace(
        CUresult=SimpleNamespace(CUDA_SUCCESS="ok"),
        CUdriverProcAddressQueryResult=results,
        cuDriverGetVersion=lambda: ("ok", version),
        cuGetProcAddress=get_proc_address,
        asked=asked,
        fakes=fakes,
    )


@pytest.mark.parametrize(
    ("version", "served", "expected"),
    [
        (13000, {ABI_13_0: True, ABI_12_8: True}, ABI_13_0),
        (13000, {ABI_13_0: False, ABI_12_8: True}, ABI_12_8),
        (12080, {ABI_12_8: True}, ABI_12_8),
        (12060, {ABI_12_8: True}, None),
    ],
)
def test_the_abi_follows_the_driver_version_and_the_symbol_status(
    version: int, served: dict[int, bool], expected: int | None
) -> None:
    driver = _driver_module(version, served)
    entry = select_entry(driver)
    if expected is None:
        assert entry is None and driver.asked == []
        return
    assert entry is not None
    function, abi = entry
    assert abi == expected
    plan, src, dst, _keep = scattered_plan(10)
    BatchMemcpy(function, abi)(plan, STREAM)  # the bound signature matches the entry
    assert dst == src
    assert driver.fakes[expected].calls[0]["has_fail_idx"] is (expected == ABI_12_8)
