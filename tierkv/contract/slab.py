"""The primary slab as a tier sees it: fixed-size rows of writable host memory.

Part of the plugin contract, so it imports nothing heavy: a `PrimaryView` is built over
any writable, C-contiguous buffer (a `bytearray`, an `mmap`, a numpy array, the
`memoryview` vLLM hands its secondary tiers, the core's pinned torch slab). A tier
reads `block(slot)` on store and writes it on load; both are zero-copy views.

A block may also be made of several equal regions of one buffer at a fixed stride
(`StridedView`): SGLang's host pool keeps a page's K and its V in the two halves of one
buffer, and storing the page as one block (one file, one header, one checksum) halves a
tier's work per page against two blocks of half the size. A tier that handles such
blocks declares `accepts_regions` and moves `regions(slot)` (the block's bytes are
those regions joined, in order: the frame is the same as for one contiguous block of
those bytes); every view answers `regions`, a plain one with its single region.

More generally a block may be any set of regions at any addresses (`GatherView`): a
list of *lanes*, each a buffer, where its slot 0 starts, the bytes between one slot and
the next, and the bytes of its region, so that block `s` is lane 0's region of slot
`s`, then lane 1's, and so on. SGLang's `layer_first` host pool (a page's K and V of
each layer: 2 x layers lanes in one buffer), its split MLA pool (K and V in two
buffers) and a hybrid model's Mamba pool (three buffers, three region sizes) each keep
a page as one block that way.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["GatherView", "Lane", "PrimaryView", "Regions", "StridedView"]

PLACEMENT_PAGE = 4096
"""The largest modulus `PrimaryView.placement` reports: copies are slow or fast by
where source and destination lie within a page."""


def _low_bit(value: int) -> int:
    """The largest power of two dividing `value`, at most PLACEMENT_PAGE (0: the cap)."""
    return min(value & -value, PLACEMENT_PAGE) if value else PLACEMENT_PAGE

Regions = tuple[memoryview, ...]
"""A block's bytes as the writable regions they lie in, in order."""

Lane = tuple[Any, int, int, int]
"""One region of every block of a `GatherView`: (buffer, offset of slot 0's region in
it, bytes from one slot's region to the next, bytes of the region)."""


class PrimaryView:
    """Slab geometry, the namespace, and a writable zero-copy `memoryview` per slot.

    The cache keeps a slot handed to a job protected until the job's result is taken;
    a tier never touches a slot after its job returned or was cancelled.
    """

    _address: int | None = None
    """Where the buffer starts, when known (a subclass without one slab: unknown)."""

    engine_owned: bool = False
    """True when an engine owns the slots (`tierkv.driver.SyncChain` sets it): the engine
    hands a slot to other data as soon as a call answers, at its deadline at the latest,
    and cannot hold it while a tier's thread still runs. A tier whose worker thread may
    outlive its job's deadline (a transfer a frozen peer holds up) must then not write a
    slot from that thread after the deadline: it lands the bytes in memory of its own
    and copies them in only while the job is on time (`tierkv_mooncake`), or starts no
    block past the deadline (`tierkv_nvme`). Under `TieredCache` it stays False: the
    cache holds the slots of a job left running until the job ends."""

    def __init__(self, buffer: Any, block_bytes: int, namespace: str) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        try:
            view = memoryview(buffer)
        except TypeError as exc:
            raise ValueError(
                f"the primary slab must be a buffer (bytearray, memoryview, array), "
                f"not {type(buffer).__name__}"
            ) from exc
        if view.readonly:
            raise ValueError("the primary slab must be writable")
        if not view.c_contiguous:
            raise ValueError("the primary slab must be C-contiguous")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes == 0 or view.nbytes % block_bytes:
            raise ValueError(
                f"the primary slab is {view.nbytes} bytes, not a positive multiple of "
                f"block_bytes={block_bytes}"
            )
        self._bytes = view
        self._block_bytes = block_bytes
        self._num_blocks = view.nbytes // block_bytes
        self.namespace = namespace
        try:
            self._address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        except (TypeError, ValueError):  # a buffer ctypes cannot see into
            self._address = None

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def region_count(self) -> int:
        """Regions a block is made of: 1 here (`block` is the whole block)."""
        return 1

    def regions(self, slot: int) -> Regions:
        """The block at `slot` as its regions, writable, without a copy (here one)."""
        return (self.block(slot),)

    @property
    def placement(self) -> tuple[int, int]:
        """(modulus, residue): every region of every slot starts at an address that
        is `residue` modulo `modulus` (a power of two, at most PLACEMENT_PAGE);
        (1, 0) when the buffer's address is not known. A tier whose reads are slow at
        some distances between a file offset and the slot (the nvme tier's
        `SHORT_DISTANCE`) learns from it whether any slot can be at one."""
        if self._address is None:
            return 1, 0
        modulus = _low_bit(self._spacing())
        return modulus, self._address % modulus

    def _spacing(self) -> int:
        """What the addresses of regions differ by: multiples of this."""
        return self._block_bytes

    def payload(self, slot: int) -> memoryview | Regions:
        """What a tier that `accepts_regions` moves for `slot`: `block(slot)` here, the
        regions in a `StridedView` (`tierkv.contract.framing` takes either)."""
        return self.block(slot)

    @property
    def lanes(self) -> tuple[Lane, ...] | None:
        """Every slot's regions in one description, for a tier that moves whole batches
        in compiled code (the nvme tier's core): a `Lane` per region, (buffer, offset,
        stride, size), so that region j of slot s is `buffer[offset + s * stride:]
        [:size]` of lane j. None when the slots have no such geometry (a view whose
        slots are lent one by one, or a subclass that moves its blocks elsewhere):
        such a tier then takes `payload(slot)` per block."""
        base = PrimaryView
        cls = type(self)
        if cls.payload is not base.payload or cls.block is not base.block:
            return None
        data = getattr(self, "_bytes", None)
        if data is None:
            return None
        return ((data, 0, self._block_bytes, self._block_bytes),)

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self._num_blocks:
            raise IndexError(f"slot {slot!r} is out of range 0..{self._num_blocks - 1}")

    def block(self, slot: int) -> memoryview:
        """The bytes of `slot`, writable, without a copy."""
        self._check_slot(slot)
        start = slot * self._block_bytes
        try:
            return self._bytes[start : start + self._block_bytes]
        except ValueError:
            raise _released() from None

    def release(self) -> None:
        """Let go of the slab now, not when the last reference to this view dies.

        The owner of a slab it lends (vLLM unmaps its shared-memory primary at
        shutdown) can free it only once no view of it remains; an object that
        outlives the shutdown while holding this one (a tier, a test, a metrics
        exporter) must not keep it alive. Afterwards `block` raises ValueError.
        Idempotent. Views `block` handed out earlier stay valid until dropped: a tier
        never keeps one past its job."""
        try:
            self._bytes.release()
        except BufferError as exc:  # someone holds a buffer exported from our view
            raise BufferError(
                f"the primary slab cannot be released while a buffer taken from it is in use: {exc}"
            ) from None


def _released() -> ValueError:
    """The error for a block of a slab whose buffer was released."""
    return ValueError(
        "the primary slab was released (its tier was shut down); "
        "no block of it can be read or written any more"
    )


class StridedView(PrimaryView):
    """Blocks of `region_count` regions of `region_bytes` each, `stride` bytes apart in
    `buffer`: the block at slot `s` is the regions starting at `s * region_bytes + j *
    stride` for `j` in `0..region_count - 1` (so `block_bytes` is `region_count *
    region_bytes`). Slots run while every region of the block lies in the buffer.
    `block(slot)` refuses (the bytes are not contiguous): only a tier that declares
    `accepts_regions` is given such a view, and it reads `regions(slot)`."""

    def __init__(
        self, buffer: Any, region_bytes: int, region_count: int, stride: int, namespace: str
    ) -> None:
        for name, value in (("region_bytes", region_bytes), ("region_count", region_count)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < region_bytes:
            raise ValueError(
                f"stride must be an int of at least region_bytes={region_bytes} "
                f"(regions of one block must not overlap), got {stride!r}"
            )
        whole = memoryview(buffer)
        if whole.format != "B" or whole.ndim != 1:
            whole = whole.cast("B")
        span = (region_count - 1) * stride  # from a block's first region to its last
        # slots count in the whole regions of the buffer (what the slab keeps below), so
        # that each slot's last region ends inside it
        kept = whole.nbytes - whole.nbytes % region_bytes
        usable = (kept - span) // region_bytes * region_bytes
        if usable <= 0:
            raise ValueError(
                f"a buffer of {whole.nbytes} bytes holds no block of {region_count} regions "
                f"of {region_bytes} bytes {stride} bytes apart"
            )
        # every check of a plain slab, over the whole regions of the buffer
        whole = whole[:kept]
        super().__init__(whole, region_bytes, namespace)
        self._region_bytes = region_bytes
        self._region_count = region_count
        self._stride = stride
        self._block_bytes = region_count * region_bytes
        self._num_blocks = usable // region_bytes

    @property
    def region_count(self) -> int:
        return self._region_count

    @property
    def region_bytes(self) -> int:
        return self._region_bytes

    @property
    def stride(self) -> int:
        return self._stride

    def regions(self, slot: int) -> Regions:
        self._check_slot(slot)
        size, stride = self._region_bytes, self._stride
        start = slot * size
        try:
            data = self._bytes
            if self._region_count == 2:  # a page's K and V: the common case, on every job
                return (data[start : start + size], data[start + stride : start + stride + size])
            starts = range(start, start + self._region_count * stride, stride)
            return tuple([data[at : at + size] for at in starts])
        except ValueError:
            raise _released() from None

    def payload(self, slot: int) -> memoryview | Regions:
        return self.regions(slot)

    @property
    def lanes(self) -> tuple[Lane, ...] | None:
        size = self._region_bytes
        return tuple((self._bytes, j * self._stride, size, size) for j in range(self._region_count))

    def _spacing(self) -> int:
        return self._region_bytes | self._stride

    def block(self, slot: int) -> memoryview:
        raise TypeError(
            f"a block of this view is {self._region_count} regions {self._stride} bytes "
            "apart, not one run of bytes: a tier reads it with regions(slot) and declares "
            "accepts_regions"
        )





def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class GatherView(PrimaryView):
    """Blocks of one region per *lane*, each at its own place (see the module
    docstring): the block at slot `s` is, for each lane `(buffer, offset, stride,
    size)` in order, `buffer[offset + s * stride : offset + s * stride + size]`, so
    `block_bytes` is the sum of the lanes' sizes and `region_count` their number.
    Lanes may share a buffer; slots run while every lane's region lies in its buffer,
    and (with `num_blocks`) no further than that many.
    Regions are views of the buffers (no copy). `block(slot)` refuses (the bytes are
    not contiguous): only a tier that declares `accepts_regions` is given such a view,
    and it moves `regions(slot)`."""

    def __init__(self, lanes: Any, namespace: str, *, num_blocks: int | None = None) -> None:
        lanes = list(lanes)
        if not lanes:
            raise ValueError("a GatherView needs at least one lane")
        views: list[memoryview] = []
        wholes: list[memoryview] = []
        sizes: list[int] = []
        strides: list[int] = []
        starts: list[int | None] = []
        count: int | None = None
        for i, lane in enumerate(lanes):
            try:
                buffer, offset, stride, size = lane
            except (TypeError, ValueError):
                raise ValueError(
                    f"lane {i} must be (buffer, offset, stride, size), got {lane!r}"
                ) from None
            size = _positive(f"lane {i}'s size", size)
            stride = _positive(f"lane {i}'s stride", stride)
            if stride < size:
                raise ValueError(
                    f"lane {i}'s stride must be at least its size={size} (the regions of "
                    f"two blocks must not overlap), got {stride!r}"
                )
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ValueError(f"lane {i}'s offset must be an int >= 0, got {offset!r}")
            whole = _writable_bytes(buffer, f"lane {i}'s buffer")
            room = whole.nbytes - offset - size
            fits = room // stride + 1 if room >= 0 else 0
            if fits <= 0:
                raise ValueError(
                    f"lane {i}: a buffer of {whole.nbytes} bytes holds no region of {size} "
                    f"bytes at offset {offset}"
                )
            count = fits if count is None else min(count, fits)
            wholes.append(whole)
            views.append(whole[offset:])
            sizes.append(size)
            strides.append(stride)
            starts.append(None if (at := _address_of(whole)) is None else at + offset)
        assert count is not None
        if num_blocks is not None:
            count = min(count, _positive("num_blocks", num_blocks))
        self._bytes = wholes[0]
        self._wholes = wholes
        self._lanes = views
        self._sizes = tuple(sizes)
        self._strides = tuple(strides)
        self._starts = starts
        self._block_bytes = sum(sizes)
        self._num_blocks = count
        self.namespace = namespace
        self._address = starts[0]
        self._lane_table = list(zip(views, strides, sizes))

    @property
    def region_count(self) -> int:
        return len(self._sizes)

    @property
    def region_sizes(self) -> tuple[int, ...]:
        """Bytes of each lane's region, in order."""
        return self._sizes

    @property
    def strides(self) -> tuple[int, ...]:
        return self._strides

    def regions(self, slot: int) -> Regions:
        self._check_slot(slot)
        try:
            return tuple([
                view[slot * stride : slot * stride + size]
                for view, stride, size in self._lane_table
            ])
        except ValueError:
            raise _released() from None

    def payload(self, slot: int) -> memoryview | Regions:
        return self.regions(slot)

    @property
    def lanes(self) -> tuple[Lane, ...] | None:
        return tuple((view, 0, stride, size) for view, stride, size in self._lane_table)

    @property
    def placement(self) -> tuple[int, int]:
        if any(start is None for start in self._starts):
            return 1, 0
        first = self._starts[0]
        assert first is not None
        spacing = 0
        for start, stride, size in zip(self._starts, self._strides, self._sizes):
            assert start is not None
            spacing |= (start - first) | stride | size
        modulus = _low_bit(spacing)
        return modulus, first % modulus

    def block(self, slot: int) -> memoryview:
        raise TypeError(
            f"a block of this view is {len(self._sizes)} regions at their own places, not "
            "one run of bytes: a tier reads it with regions(slot) and declares "
            "accepts_regions"
        )

    def release(self) -> None:
        """As `PrimaryView.release`, for every lane's buffer."""
        for view in (*self._lanes, *self._wholes):
            try:
                view.release()
            except BufferError as exc:
                raise BufferError(
                    "the primary slab cannot be released while a buffer taken from it is "
                    f"in use: {exc}"
                ) from None


def _writable_bytes(buffer: Any, what: str) -> memoryview:
    """`buffer` as a flat, writable memoryview of bytes; ValueError saying why not."""
    try:
        view = memoryview(buffer)
    except TypeError as exc:
        raise ValueError(
            f"{what} must be a buffer (bytearray, memoryview, array), "
            f"not {type(buffer).__name__}"
        ) from exc
    if view.readonly:
        raise ValueError(f"{what} must be writable")
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _address_of(view: memoryview) -> int | None:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None
