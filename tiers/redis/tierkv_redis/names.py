"""How blocks are named in Redis, and how a frame is cut into values.

    <key_prefix><namespace tag>:{<key hex>}                    a frame in one value
    <key_prefix><namespace tag>:{<key hex>}:p<part size>       first part of a split frame
    <key_prefix><namespace tag>:{<key hex>}:p<part size>:<i>   its part i >= 1
    <key_prefix><namespace tag>:{<key hex>}:f<part size>       first part of a fitted frame
    <key_prefix><namespace tag>:{<key hex>}:f<part size>:<i>   its part i >= 1

A split frame is cut into parts of equal size (the last may be shorter): `n =
ceil(frame / part_size)` parts of `ceil(frame / n)` bytes, so a frame just over the
part size becomes two halves, not a full part and a sliver. Readers join the parts in
order, whatever their sizes.

A fitted frame (`fit_values: true`, frames of FIT_MIN_FRAME and up) is cut so that
Redis's allocator wastes nothing on it. Redis keeps a string value in one jemalloc
allocation of the value's length plus ~12 bytes, rounded up to a size class (four per
doubling: 1, 1.25, 1.5, 1.75, 2 MiB...). A block of a power-of-two size plus its header
lands just past a class: a 1 MiB block took a 1.25 MiB allocation, and Redis's
`maxmemory` held 20 % fewer blocks than its size (measured, Redis 7.0: 1.25-1.29x
`used_memory` per byte stored; LMCache's `resp` adapter 1.33x at 1 MiB, 1.88x at
8 MiB). A fitted frame's `n` parts are each ALLOC_SLACK short of a size class, and the
few bytes left (the header's worth, at most FIT_MAX_TAIL) go in one small last part:
1.00-1.03x. The in-turn paths send a small part's command together with the one before
it (`gets`, `wire`), so the extra value costs no round trip. It is off by default:
GETs of values just under a size class cost that redis-server more CPU (loads 7-20 %
slower at 256 KiB-2 MiB, ~38 % at 8 MiB; the tier's README).

The namespace tag is 128 bits of sha256 of the namespace, so two namespaces never name
the same value (and the frame header checks the namespace again on the way back). The
braces are a Redis Cluster hash tag: every part of one block lives in the same slot,
so one multi-key EXISTS or UNLINK covers a whole block, on a cluster too. The part
size is in the names of a split frame, so servers sharing a namespace with different
`part_size` settings miss each other's split blocks instead of misreading (or
deleting) them.
"""

from __future__ import annotations

import hashlib

from tierkv.contract.framing import header_bytes
from tierkv.tier import OffloadKey


def namespace_tag(namespace: str) -> str:
    """32 hex digits that stand for `namespace` in stored names."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:32]


def frame_bytes(key: OffloadKey, block_bytes: int, *, mac: bool = False) -> int:
    """Length of the stored frame of one block (with a MAC if `mac`)."""
    return header_bytes(key, mac=mac) + block_bytes


def num_parts(frame_length: int, part_size: int) -> int:
    """How many values of at most `part_size` a frame of `frame_length` bytes needs."""
    return max(1, -(-frame_length // part_size))


ALLOC_SLACK = 64
"""Bytes a fitted part is short of its allocator size class: Redis 7.0 allocates a
string value's length plus 12 bytes (sds header, terminator; measured: a value 12
bytes short of 1, 4 or 8 MiB used its class, 8 bytes short the next), with margin for
other versions' headers."""
FIT_MIN_FRAME = 256 << 10
"""Frames from this size up are fitted (`fit_values`): the small last part is one more
command per block, which costs smaller blocks more than their waste is worth."""
FIT_MIN_PART = 64 << 10
"""Fitted parts are at least this long (a `part_size` of a few KiB is not fitted:
jemalloc's classes are spaced otherwise there, and the waste is small in bytes)."""
FIT_MAX_TAIL = 4096
"""A frame whose fitted cut would leave more than this in its last part is cut as
before: the fitting is for a power-of-two block and its header."""


def size_class(length: int) -> int:
    """The size jemalloc (Redis's allocator) rounds an allocation of `length` bytes up
    to, for lengths of a few KiB and more: four classes per power of two."""
    if length <= 0:
        return 0
    step = 1 << max(length.bit_length() - 3, 0)  # a quarter of the power of two below
    return -(-length // step) * step


def class_floor(length: int) -> int:
    """The largest size class of at most `length` bytes (`size_class`)."""
    step = 1 << max(length.bit_length() - 3, 0)
    return length // step * step


def fitted_lengths(frame_length: int, part_size: int) -> list[int] | None:
    """The value lengths of a fitted frame: `n` parts each ALLOC_SLACK short of a size
    class (at least as many as `part_size` asks, at most twice), then one small last
    part; None when the frame is stored as before: it is under FIT_MIN_FRAME, its
    parts fit already, or no such cut leaves a small last part."""
    if frame_length < FIT_MIN_FRAME:
        return None
    count = num_parts(frame_length, part_size)
    even = -(-frame_length // count)
    if size_class(even + ALLOC_SLACK) == even + ALLOC_SLACK:
        return None  # the equal parts fit already
    for n in range(count, 2 * count + 1):
        # parts of at most ceil(frame / n) <= part_size, rounded down to fit a class
        fitted = class_floor(-(-frame_length // n) + ALLOC_SLACK) - ALLOC_SLACK
        tail = frame_length - n * fitted
        if fitted >= FIT_MIN_PART and 0 < tail <= min(FIT_MAX_TAIL, part_size):
            return [fitted] * n + [tail]
    return None


class BlockNames:
    """Stored names for one tier: a fixed prefix (key_prefix + namespace tag)."""

    def __init__(
        self,
        key_prefix: str,
        namespace: str,
        block_bytes: int,
        part_size: int,
        *,
        mac: bool = False,
        fit: bool = False,
    ) -> None:
        self.prefix = f"{key_prefix}{namespace_tag(namespace)}:"
        self.block_bytes = block_bytes
        self.part_size = part_size
        self.mac = mac
        self.fit = fit
        self._layouts: dict[int, tuple[str, list[tuple[int, int]]]] = {}

    def _layout(self, key: OffloadKey) -> tuple[str, list[tuple[int, int]]]:
        """(name marker, part bounds) of `key`'s frame; per frame length, computed
        once (the length depends on the key's length and the MAC only)."""
        frame = frame_bytes(key, self.block_bytes, mac=self.mac)
        known = self._layouts.get(frame)
        if known is not None:
            return known
        lengths = fitted_lengths(frame, self.part_size) if self.fit else None
        marker = "f"
        if lengths is None:
            marker = "p"
            count = num_parts(frame, self.part_size)
            size = -(-frame // count)
            lengths = [min(size, frame - i * size) for i in range(count)]
        bounds, at = [], 0
        for length in lengths:
            bounds.append((at, at + length))
            at += length
        self._layouts[frame] = layout = (marker, bounds)
        return layout

    def parts_of(self, key: OffloadKey) -> int:
        """How many values the frame of `key` is stored as."""
        return len(self._layout(key)[1])

    def split(self, key: OffloadKey) -> bool:
        """Whether the frame of `key` is larger than `part_size` (several full-size
        values: such a block takes a pipeline of its own)."""
        return frame_bytes(key, self.block_bytes, mac=self.mac) > self.part_size

    def part_bounds(self, key: OffloadKey) -> list[tuple[int, int]]:
        """(start, end) of each part within the frame of `key`, in part order."""
        return self._layout(key)[1]

    def main(self, key: OffloadKey) -> str:
        """The name of the whole frame, or of its first part."""
        return self.all(key)[0]

    def all(self, key: OffloadKey) -> list[str]:
        """Every name the block of `key` is stored under, the main name first."""
        whole = f"{self.prefix}{{{key.hex()}}}"
        marker, bounds = self._layout(key)
        if len(bounds) == 1:
            return [whole]
        main = f"{whole}:{marker}{self.part_size}"
        return [main] + [f"{main}:{i}" for i in range(1, len(bounds))]
