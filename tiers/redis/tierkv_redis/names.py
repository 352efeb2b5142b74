"""How blocks are named in Redis.

    <key_prefix><namespace tag>:{<key hex>}                    a frame in one value
    <key_prefix><namespace tag>:{<key hex>}:p<part size>       first part of a split frame
    <key_prefix><namespace tag>:{<key hex>}:p<part size>:<i>   its part i >= 1

A split frame is cut into parts of equal size (the last may be shorter): `n =
ceil(frame / part_size)` parts of `ceil(frame / n)` bytes, so a frame just over the
part size becomes two halves, not a full part and a sliver. Readers join the parts in
order, whatever their sizes.

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
    """How many values a frame of `frame_length` bytes is stored as."""
    return max(1, -(-frame_length // part_size))


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
    ) -> None:
        self.prefix = f"{key_prefix}{namespace_tag(namespace)}:"
        self.block_bytes = block_bytes
        self.part_size = part_size
        self.mac = mac

    def parts_of(self, key: OffloadKey) -> int:
        return num_parts(frame_bytes(key, self.block_bytes, mac=self.mac), self.part_size)

    def part_bounds(self, key: OffloadKey) -> list[tuple[int, int]]:
        """(start, end) of each part within the frame of `key`, in part order."""
        frame = frame_bytes(key, self.block_bytes, mac=self.mac)
        count = num_parts(frame, self.part_size)
        size = -(-frame // count)
        return [(i * size, min(frame, (i + 1) * size)) for i in range(count)]

    def main(self, key: OffloadKey) -> str:
        """The name of the whole frame, or of its first part."""
        return self.all(key)[0]

    def all(self, key: OffloadKey) -> list[str]:
        """Every name the block of `key` is stored under, the main name first."""
        whole = f"{self.prefix}{{{key.hex()}}}"
        count = self.parts_of(key)
        if count == 1:
            return [whole]
        main = f"{whole}:p{self.part_size}"
        return [main] + [f"{main}:{i}" for i in range(1, count)]
