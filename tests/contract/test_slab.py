"""The contract's slab view: zero-copy rows over any writable buffer, no torch."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
from typing import Any

import pytest

from tierkv.contract.slab import GatherView, PrimaryView, StridedView


def test_rows_are_writable_zero_copy_views_of_the_buffer() -> None:
    buf = bytearray(4 * 8)
    view = PrimaryView(buf, 8, "ns")
    assert (view.num_blocks, view.block_bytes, view.namespace) == (4, 8, "ns")
    view.block(2)[:] = b"abcdefgh"
    assert bytes(buf[16:24]) == b"abcdefgh"
    buf[0:8] = b"12345678"
    assert bytes(view.block(0)) == b"12345678"


def test_a_vllm_style_memoryview_is_accepted() -> None:
    view = PrimaryView(memoryview(bytearray(64)), 16, "ns")
    assert view.num_blocks == 4


@pytest.mark.parametrize("slot", [-1, 4, True, 1.0])
def test_slots_out_of_range_are_refused(slot: object) -> None:
    view = PrimaryView(bytearray(32), 8, "ns")
    with pytest.raises(IndexError, match=r"out of range 0\.\.3"):
        view.block(slot)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("buffer", "block_bytes", "message"),
    [
        (b"x" * 32, 8, "writable"),
        (bytearray(30), 8, "multiple of block_bytes=8"),
        (bytearray(0), 8, "multiple of block_bytes=8"),
        (bytearray(32), 0, "positive int"),
        ("not a buffer", 8, "must be a buffer"),
    ],
)
def test_bad_slabs_are_refused_with_a_reason(
    buffer: object, block_bytes: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        PrimaryView(buffer, block_bytes, "ns")


def test_the_plugin_contract_imports_no_torch_and_no_cache() -> None:
    code = (
        "import sys, tierkv.tier, tierkv.contract.framing;"
        "heavy = ('torch', 'tierkv.primary', 'tierkv.cache');"
        "print(','.join(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_a_released_view_lets_the_owner_free_the_slab_and_refuses_later_use() -> None:
    import mmap

    region = mmap.mmap(-1, 4 * 64)
    view = PrimaryView(region, 64, "ns")
    view.block(1)[:] = b"x" * 64  # a slot view, dropped at once as a tier drops it
    with pytest.raises(BufferError):
        region.close()  # the view still exports the mapping
    view.release()
    view.release()  # idempotent
    region.close()  # nothing of ours holds it any more
    with pytest.raises(ValueError, match="released"):
        view.block(0)


# -- blocks of several regions (StridedView) -------------------------------------------
def test_a_strided_block_is_its_regions_stride_apart_without_a_copy() -> None:
    """A page's K and V in the two halves of one buffer: slot s is region s of each half."""
    buffer = bytearray(range(256)) * 4  # 1,024 bytes: halves of 512, regions of 64
    view = StridedView(buffer, 64, 2, 512, "ns")
    assert (view.num_blocks, view.block_bytes, view.region_count) == (8, 128, 2)
    k, v = view.regions(3)
    assert bytes(k) == bytes(buffer[192:256]) and bytes(v) == bytes(buffer[704:768])
    k[:] = b"\xaa" * 64
    v[:] = b"\xbb" * 64
    assert buffer[192:256] == b"\xaa" * 64 and buffer[704:768] == b"\xbb" * 64
    assert view.regions(7)[1].nbytes == 64 and bytes(view.regions(7)[1]) == bytes(buffer[960:])
    assert [bytes(r) for r in view.payload(3)] == [b"\xaa" * 64, b"\xbb" * 64]


def test_a_strided_view_refuses_block_and_slots_past_its_last_whole_block() -> None:
    # the view keeps the buffer's whole regions (960 bytes): every slot's last region
    # ends inside them
    view = StridedView(bytearray(1000), 64, 3, 300, "ns")
    assert view.num_blocks == (960 - 600) // 64
    last = view.regions(view.num_blocks - 1)
    assert [len(r) for r in last] == [64, 64, 64]
    with pytest.raises(IndexError):
        view.regions(view.num_blocks)
    with pytest.raises(TypeError, match="accepts_regions"):
        view.block(0)


@pytest.mark.parametrize(
    ("region_bytes", "count", "stride", "match"),
    [
        (0, 2, 64, "region_bytes"),
        (64, 0, 64, "region_count"),
        (64, 2, 32, "must not overlap"),
        (64, 2, 4096, "holds no block"),
    ],
)
def test_bad_strided_views_are_refused_with_a_reason(
    region_bytes: int, count: int, stride: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        StridedView(bytearray(1024), region_bytes, count, stride, "ns")


def test_a_plain_view_is_one_region() -> None:
    buffer = bytearray(b"0123456789abcdef")
    view = PrimaryView(buffer, 8, "ns")
    assert view.region_count == 1
    (only,) = view.regions(1)
    assert bytes(only) == b"89abcdef"
    payload = view.payload(1)
    assert isinstance(payload, memoryview) and bytes(payload) == b"89abcdef"


def test_a_tier_that_moves_one_run_of_bytes_refuses_a_strided_view() -> None:
    """A tier that does not declare `accepts_regions` would read `block(slot)`: it is
    refused a `StridedView` when built, never half a block later."""
    from tierkv.contract.jobs import JobMetadata, JobResult
    from tierkv.contract.tier import SecondaryTierManager, TierConfig

    class OneRun(SecondaryTierManager):
        @staticmethod
        def get_tier_type() -> str:
            return "one-run"

        async def lookup(self, keys: object, ctx: object) -> list[bool]:
            return []

        async def store(self, job: JobMetadata) -> JobResult:
            return JobResult.success(job)

        async def load(self, job: JobMetadata) -> JobResult:
            return JobResult.success(job)

        async def remove(self, keys: object) -> None:
            pass

    view = StridedView(bytearray(1024), 64, 2, 512, "ns")
    with pytest.raises(TypeError, match="'one-run' moves a block as one run of bytes"):
        OneRun(TierConfig(type="one-run"), view)
    OneRun(TierConfig(type="one-run"), PrimaryView(bytearray(1024), 128, "ns"))  # fine


def test_placement_says_where_every_slot_starts_within_a_page() -> None:
    """(modulus, residue) per slab: a page-aligned buffer of page-sized blocks, a
    buffer 64 bytes into a page (torch's CPU tensors), odd block sizes, a strided view
    whose stride or region size sets the modulus."""
    area = mmap.mmap(-1, 1 << 20)
    whole = memoryview(area)
    assert PrimaryView(whole, 8192, "ns").placement == (4096, 0)
    assert PrimaryView(whole[64 : 64 + 65536], 4096, "ns").placement == (4096, 64)
    assert PrimaryView(whole[64 : 64 + 96 * 10], 96, "ns").placement == (32, 0)
    assert PrimaryView(whole[10 : 10 + 8192], 4096, "ns").placement == (4096, 10)
    strided = StridedView(whole[64 : 64 + (1 << 19)], 32768, 2, 1 << 18, "ns")
    assert strided.placement == (4096, 64)
    assert StridedView(whole, 4096, 2, 4096 + 192, "ns").placement == (64, 0)
    for view in (strided, PrimaryView(whole[64 : 64 + 96 * 10], 96, "ns")):
        modulus, residue = view.placement
        starts = [
            ctypes.addressof(ctypes.c_char.from_buffer(region))
            for slot in range(view.num_blocks)
            for region in view.regions(slot)
        ]
        assert {start % modulus for start in starts} == {residue}
        view.release()


def test_a_view_without_one_slab_has_an_unknown_placement() -> None:
    """A subclass that lends slots from elsewhere (LMCache's objects) and never calls
    `PrimaryView.__init__` answers (1, 0): every slot's distance is tested."""

    class Lent(PrimaryView):
        def __init__(self) -> None:  # no slab
            self._block_bytes, self._num_blocks, self.namespace = 64, 1, "ns"

    assert Lent().placement == (1, 0)


# -- blocks of regions at any places (GatherView) --------------------------------------
def test_a_gather_block_is_one_region_per_lane_without_a_copy() -> None:
    """Lanes of three sizes in two buffers, one lane sharing a buffer with another at its
    own stride: slot s is each lane's region s, in lane order."""
    one = bytearray(range(256)) * 4  # 1,024 bytes
    two = bytearray(b"\x00" * 300)
    view = GatherView([(one, 0, 64, 64), (one, 512, 32, 16), (two, 10, 30, 24)], "ns")
    # lane 0: (1024 - 64) // 64 + 1 = 16; lane 1: (512 - 16) // 32 + 1 = 16;
    # lane 2: (300 - 10 - 24) // 30 + 1 = 9
    assert (view.num_blocks, view.block_bytes, view.region_count) == (9, 104, 3)
    assert view.region_sizes == (64, 16, 24) and view.strides == (64, 32, 30)
    a, b, c = view.regions(3)
    assert bytes(a) == bytes(one[192:256]) and bytes(b) == bytes(one[608:624])
    c[:] = b"\xcc" * 24
    assert two[100:124] == b"\xcc" * 24 and two[99] == 0 and two[124] == 0
    assert [bytes(r) for r in view.payload(3)] == [bytes(a), bytes(b), b"\xcc" * 24]
    last = view.regions(8)
    assert bytes(last[2]) == bytes(two[250:274])
    with pytest.raises(IndexError):
        view.regions(9)
    with pytest.raises(TypeError, match="accepts_regions"):
        view.block(0)
    view.release()
    with pytest.raises(ValueError, match="released"):
        view.regions(0)


def test_a_gather_block_frames_as_its_joined_bytes() -> None:
    """A frame of a gather block is the frame of one run of the same bytes, and decodes
    back into the lanes in place."""
    from tierkv.contract.framing import Framer

    buffer = bytearray(os.urandom(4096))
    view = GatherView([(buffer, 2048, 512, 100), (buffer, 0, 256, 200)], "ns")
    framer = Framer("ns", None)
    joined = b"".join(bytes(r) for r in view.regions(2))
    frame = framer.encode(b"k" * 20, view.payload(2))
    assert bytes(frame) == bytes(framer.encode(b"k" * 20, bytearray(joined)))
    for region in view.regions(2):
        region[:] = b"\x00" * len(region)
    framer.decode_into(b"k" * 20, frame, view.payload(2))
    assert b"".join(bytes(r) for r in view.regions(2)) == joined


@pytest.mark.parametrize(
    ("lanes", "match"),
    [
        ([], "at least one lane"),
        ([(bytearray(64), 0, 64)], "must be \\(buffer"),
        ([(bytearray(64), 0, 64, 0)], "size must be a positive"),
        ([(bytearray(64), 0, 16, 32)], "must not overlap"),
        ([(bytearray(64), -1, 64, 32)], "offset"),
        ([(bytearray(64), 48, 64, 32)], "holds no region"),
        ([(bytes(64), 0, 64, 32)], "writable"),
        ([(object(), 0, 64, 32)], "must be a buffer"),
    ],
)
def test_bad_gather_views_are_refused_with_a_reason(lanes: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GatherView(lanes, "ns")


def test_a_tier_that_moves_one_run_of_bytes_refuses_a_gather_view() -> None:
    from tierkv.contract.jobs import JobMetadata, JobResult
    from tierkv.contract.tier import SecondaryTierManager, TierConfig

    class OneRun(SecondaryTierManager):
        @staticmethod
        def get_tier_type() -> str:
            return "one-run-gather"

        async def lookup(self, keys: object, ctx: object) -> list[bool]:
            return []

        async def store(self, job: JobMetadata) -> JobResult:
            return JobResult.success(job)

        async def load(self, job: JobMetadata) -> JobResult:
            return JobResult.success(job)

        async def remove(self, keys: object) -> None:
            pass

    buffer = bytearray(1024)
    refusal = r"moves a block as one run of bytes.*2 regions each \(GatherView\)"
    with pytest.raises(TypeError, match=refusal):
        OneRun(TierConfig(type="one-run-gather"), GatherView([(buffer, 0, 64, 64),
                                                              (buffer, 512, 64, 64)], "ns"))


def test_gather_placement_says_where_every_region_starts_within_a_page() -> None:
    area = mmap.mmap(-1, 1 << 20)
    whole = memoryview(area)
    # SGLang layer_first at 64 bytes into a page: K and V of two layers
    lanes = [(whole[64:], off, 4096, 4096) for off in (0, 1 << 16, 1 << 17, 3 << 16)]
    view = GatherView(lanes, "ns")
    assert view.placement == (4096, 64)
    odd = GatherView([(whole, 0, 4096, 4096), (whole, 1 << 19, 96, 96)], "ns")
    assert odd.placement == (32, 0)
    for v in (view, odd):
        modulus, residue = v.placement
        starts = [
            ctypes.addressof(ctypes.c_char.from_buffer(region))
            for slot in range(0, v.num_blocks, 7)
            for region in v.regions(slot)
        ]
        assert {start % modulus for start in starts} == {residue}
        v.release()
