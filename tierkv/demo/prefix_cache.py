"""The engine's own GPU prefix cache, as a serving engine keeps one (vLLM's automatic
prefix caching): the KV blocks of a finished request stay in the KV cache under their
block hash, and a later request whose prompt starts with the same blocks uses them in
place. It is bounded by the engine's KV blocks: a new request takes free blocks first,
then evicts the least recently used cached ones. That bound is what tierkv extends.

The unit is a *chunk*: `factor` consecutive KV blocks, one offloaded tierkv block, so a
GPU hit and a tierkv hit meet on a block boundary.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tierkv.contract.keys import OffloadKey


class ChunkAllocator:
    """KV blocks handed out in chunks of `factor`, with an optional prefix cache.

    Without `prefix_caching` a released chunk is simply free again (an engine with no
    prefix cache). With it, a released chunk that holds a full block of computed KV
    stays cached under its key until it is evicted to make room."""

    def __init__(self, num_chunks: int, factor: int, *, prefix_caching: bool) -> None:
        if num_chunks < 1 or factor < 1:
            raise ValueError("need at least one chunk of at least one block")
        self.num_chunks = num_chunks
        self.factor = factor
        self.prefix_caching = prefix_caching
        self._free = list(range(num_chunks - 1, -1, -1))
        self._key_of: dict[int, OffloadKey] = {}
        self._chunk_of: dict[OffloadKey, int] = {}
        self._refs: dict[int, int] = {}  # cached chunks in use by running requests
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unused; LRU first
        self.hit_chunks = 0
        self.evicted_chunks = 0

    @property
    def available(self) -> int:
        """Chunks a request could take now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def cached(self) -> int:
        return len(self._chunk_of)

    def blocks(self, chunks: Sequence[int]) -> list[int]:
        """The KV block ids of `chunks`, in order: a request's block table."""
        return [c * self.factor + j for c in chunks for j in range(self.factor)]

    def match(self, keys: Sequence[OffloadKey]) -> list[int]:
        """The cached chunks of the longest prefix of `keys`, now held by the caller
        (not evictable until `release`)."""
        if not self.prefix_caching:
            return []
        count = next((i for i, key in enumerate(keys) if key not in self._chunk_of), len(keys))
        return self.hold(keys[:count])

    def is_cached(self, key: OffloadKey) -> bool:
        """Whether a chunk holds `key`'s block now (a hybrid engine asks block by block:
        a sliding-window or state group needs only some blocks of a prefix)."""
        return key in self._chunk_of

    def hold(self, keys: Sequence[OffloadKey]) -> list[int]:
        """The cached chunks of `keys` (every one cached), now held by the caller."""
        found: list[int] = []
        for key in keys:
            chunk = self._chunk_of[key]
            found.append(chunk)
            self._idle.pop(chunk, None)
            self._refs[chunk] = self._refs.get(chunk, 0) + 1
        self.hit_chunks += len(found)
        return found

    def allocate(self, count: int) -> list[int]:
        """`count` chunks for new KV: free ones first, then the least recently used
        cached ones (their keys are forgotten)."""
        if count > self.available:
            raise RuntimeError(f"{count} chunks wanted, {self.available} available")
        out = []
        for _ in range(count):
            if self._free:
                out.append(self._free.pop())
                continue
            chunk, _ = self._idle.popitem(last=False)
            del self._chunk_of[self._key_of.pop(chunk)]
            self.evicted_chunks += 1
            out.append(chunk)
        return out

    def release(self, chunks: Sequence[int], keys: Sequence[OffloadKey | None]) -> None:
        """A request ended: `keys[i]` is the key of the full block of computed KV in
        `chunks[i]` (None, or fewer keys than chunks: the rest hold no full block)."""
        for i, chunk in enumerate(chunks):
            if chunk in self._refs:  # a cached chunk this request used in place
                self._refs[chunk] -= 1
                if not self._refs[chunk]:
                    del self._refs[chunk]
                    self._idle[chunk] = None  # most recently used
                continue
            key = keys[i] if i < len(keys) else None
            if self.prefix_caching and key is not None and key not in self._chunk_of:
                self._chunk_of[key] = chunk
                self._key_of[chunk] = key
                self._idle[chunk] = None
            else:
                self._free.append(chunk)
