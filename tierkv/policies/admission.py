"""Reuse-aware admission: which freshly stored blocks are worth writing to a tier.

Real prefix reuse is skewed: in the public Mooncake trace 58 % of the distinct blocks
are requested exactly once. A tier that takes every block spends its write bandwidth
and its capacity on blocks nobody reads, and evicts the ones somebody would have. The
signals the cache has at store time, cheaply:

- **Sightings.** How many requests contained the block, remembered past its eviction
  in a count-min sketch (`SightingSketch`): a block seen a second time is far more
  likely to be seen a third than a new block to be seen a second time (the TinyLFU
  argument; it holds for any workload whose reuse is skewed, not for one trace).
- **Continuation.** A request whose lookup hit at least half of its blocks continues
  something cached (the next turn of a conversation): its new tail is the prefix of
  the turn after, so it is admitted on first sight.

`ReuseAdmission.admits` answers for a batch of keys in one numpy pass (well under a
microsecond per block for request-sized batches); memory is fixed by the sketch's
size and the bounded set of continuing keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

MIN_SIGHTINGS = 2
"""Sightings (requests containing the block, this one included) that admit a block."""

CONTINUATION_SHARE = 0.5
"""A request whose hit covers at least this share of its blocks continues a cached
prefix: its new blocks are admitted on first sight."""

_M64 = (1 << 64) - 1


class SightingSketch:
    """Approximate per-key counts in fixed memory: a count-min sketch of `depth` rows
    of `2**width_bits` saturating 8-bit counters. Counts only grow by `add` and are
    halved every `10 x width` additions, so old popularity fades (a block popular an
    hour ago does not crowd out today's). An estimate never undercounts a key's
    additions since the last halving; it may overcount by collisions."""

    def __init__(self, width_bits: int = 20, depth: int = 4) -> None:
        if not 4 <= width_bits <= 30:
            raise ValueError(f"width_bits must be in 4..30, got {width_bits}")
        if not 1 <= depth <= 8:
            raise ValueError(f"depth must be in 1..8, got {depth}")
        self.width = 1 << width_bits
        self.depth = depth
        self._shift = np.uint64(64 - width_bits)
        self._table = np.zeros((depth, self.width), dtype=np.uint8)
        self._rows = np.arange(depth, dtype=np.uint64)[:, None]
        self._added = 0
        self.reset_every = 10 * self.width
        self.halvings = 0

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)

    def _slots(self, keys: Sequence[bytes]) -> np.ndarray:
        """`[depth, n]` counter indices of `keys` (double hashing over Python's
        per-process bytes hash: keys are already hashes, this only spreads them)."""
        h = np.fromiter((hash(k) & _M64 for k in keys), dtype=np.uint64, count=len(keys))
        with np.errstate(over="ignore"):
            h2 = (h * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
            mixed = (h[None, :] + self._rows * h2[None, :]) * np.uint64(0xBF58476D1CE4E5B9)
        slots: np.ndarray = (mixed >> self._shift).astype(np.intp)
        return slots

    def add(self, keys: Sequence[bytes]) -> np.ndarray:
        """Count one sighting of each key (pass each key once per request); returns
        the keys' estimated sightings, this one included."""
        if not keys:
            return np.zeros(0, dtype=np.uint8)
        slots = self._slots(keys)
        result: np.ndarray | None = None
        for row in range(self.depth):
            counters = self._table[row]
            idx = slots[row]
            current = counters[idx]
            # saturating increment; duplicates within one batch count once
            bumped = np.where(current < 255, current + 1, current).astype(np.uint8)
            counters[idx] = bumped
            result = bumped if result is None else np.minimum(result, bumped)
        self._added += len(keys)
        if self._added >= self.reset_every:
            self._table >>= 1
            self._added //= 2
            self.halvings += 1
        assert result is not None
        return result

    def estimate(self, keys: Sequence[bytes]) -> np.ndarray:
        """The estimated sightings of each key (uint8 array, len(keys))."""
        if not keys:
            return np.zeros(0, dtype=np.uint8)
        slots = self._slots(keys)
        result: np.ndarray = self._table[0][slots[0]]
        for row in range(1, self.depth):
            result = np.minimum(result, self._table[row][slots[row]])
        return result


class ReuseAdmission:
    """Decides, per freshly stored block, whether a tier with `admission: reuse`
    should be written (see the module doc). Fed by every lookup (`sighted`)."""

    def __init__(
        self,
        *,
        min_sightings: int = MIN_SIGHTINGS,
        continuation_share: float = CONTINUATION_SHARE,
        width_bits: int = 20,
        max_continuing: int = 1 << 16,
    ) -> None:
        self.min_sightings = min_sightings
        self.continuation_share = continuation_share
        self.sketch = SightingSketch(width_bits)
        self._continuing: OrderedDict[bytes, None] = OrderedDict()
        self.max_continuing = max_continuing

    def sighted(self, keys: Sequence[bytes], tail: Sequence[bytes] = ()) -> np.ndarray:
        """One request looked up `keys` (distinct) and missed `tail` (the keys past
        its hit). Returns the keys' sightings after counting this one."""
        counts = self.sketch.add(keys)
        n, missed = len(keys), len(tail)
        if missed and n > missed and n - missed >= self.continuation_share * n:
            continuing = self._continuing
            for key in tail:
                continuing[key] = None
                continuing.move_to_end(key)
            while len(continuing) > self.max_continuing:
                continuing.popitem(last=False)
        return counts

    def admits(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key: write it to the tier now?"""
        counts = self.sketch.estimate(keys)
        continuing = self._continuing
        need = self.min_sightings
        return [bool(c >= need) or key in continuing for key, c in zip(keys, counts.tolist())]
