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

**Relative to what it would evict** (`admission: tinylfu`, `ReuseAdmission.admits_against`).
A fixed rule admits the same share of blocks whatever the tier's size: declining a
conversation's first turn saves a small tier from churn and costs a large one its
next-turn hit (issue 36). The TinyLFU answer is to weigh the newcomer against the block
the tier would evict for it (`SecondaryTierManager.eviction_candidates`):

1. while the tier has free room (`room()`), admit: nothing is displaced;
2. a block seen in at least `MIN_SIGHTINGS` requests, or new in a continuing request,
   is admitted, as `reuse` would (it displaces the next candidate);
3. a block seen once is admitted only if it was seen more often than the candidate it
   would displace, whose estimate counts 0 while it is resident in the primary (its
   tier copy is not what serves it) and fades as the sketch ages: the aging period is
   tied to the tier's size (`AGING_PER_BLOCK` sightings per block the admitting tiers
   hold), so a tier full of blocks nobody has asked for in a long while lets new ones
   in, and a small tier full of live ones keeps them.

A W-TinyLFU window (a segment of the tier that takes every new block) was tried in a
simulation of the conversation trace: it writes every stored block, as write-all does,
so it cannot keep writes low; the primary, the free room and the continuation rule are
the window here (`docs/bench.md`, "Measured: the capacity sweep", says what that costs).
`admission: adaptive` (`tierkv.policies.adaptive`) chooses between this rule and
write-all by measuring both on sampled shadow chains.
The decision is O(1) per block: one batched sketch estimate of the keys together with
as many candidates as keys past the free room, read lazily from the tier's order
(0.3-0.4 CPU us a block in 1,024-block calls, 0.5-0.9 in 32-block ones, where numpy's
fixed cost per call dominates: `benchmarks/admission_cost.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from itertools import islice

import numpy as np
from xxhash import xxh3_64_intdigest

MIN_SIGHTINGS = 2
"""Sightings (requests containing the block, this one included) that admit a block."""

CONTINUATION_SHARE = 0.5
"""A request whose hit covers at least this share of its blocks continues a cached
prefix: its new blocks are admitted on first sight."""

_MULTIPLIERS = (
    0x9E3779B97F4A7C15,
    0xBF58476D1CE4E5B9,
    0x94D049BB133111EB,
    0xD6E8FEB86659FD93,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0xFF51AFD7ED558CCD,
    0xC4CEB9FE1A85EC53,
)
"""One odd 64-bit multiplier per sketch row (well-known mixing constants)."""

AGING_PER_BLOCK = 10
"""With `tinylfu` tiers, the sketch halves its counts every this many sightings per
block the largest of them holds (Caffeine's sample of ten times the cache's size)."""
_BUMPED = np.minimum(np.arange(256) + 1, 255).astype(np.uint8)
"""A counter's value after one more sighting (saturating at 255), by its value now."""
MIN_AGING_PERIOD = 4096
"""Sightings between halvings at the least, however small the tier."""


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
        self._flat = self._table.reshape(-1)  # the same counters, one row after another
        self._multipliers = np.array(_MULTIPLIERS[:depth], dtype=np.uint64)[:, None]
        self._row_start = np.arange(depth, dtype=np.uint64)[:, None] * np.uint64(self.width)
        self._added = 0
        self.reset_every = 10 * self.width
        self.halvings = 0

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)

    def _slots(self, keys: Sequence[bytes]) -> np.ndarray:
        """`[depth, n]` indices of `keys`' counters in the flattened table: per row,
        the top bits of the key's xxh3_64 times an odd multiplier of that row
        (multiply-shift, a universal family). xxh3 of the whole key, not Python's
        `hash()`: that one is salted per process, so two runs of one replay could
        collide differently and give different verdicts; xxh3 costs the same here
        (~80 ns a key through `map`). Four numpy calls: at request-sized batches their
        fixed cost, not the arithmetic, is the price (array arithmetic wraps silently).
        Signed (the indices fit), as `take` and `put` want: cheaper than `[]`."""
        h = np.fromiter(map(xxh3_64_intdigest, keys), dtype=np.uint64, count=len(keys))
        slots = h * self._multipliers
        slots >>= self._shift
        slots += self._row_start
        signed: np.ndarray = slots.view(np.int64)  # below 2**33: what take/put index by
        return signed

    def add(self, keys: Sequence[bytes]) -> np.ndarray:
        """Count one sighting of each key (pass each key once per request); returns
        the keys' estimated sightings, this one included."""
        if not keys:
            return np.zeros(0, dtype=np.uint8)
        return self.add_slots(self._slots(keys), len(keys))

    def add_then_estimate(
        self, keys: Sequence[bytes], others: Sequence[bytes]
    ) -> tuple[np.ndarray, np.ndarray]:
        """`add(keys)`, then `estimate(others)`, hashing both batches in one pass
        (request-sized batches pay numpy's fixed cost per call, not per key)."""
        n = len(keys)
        if not n:
            return np.zeros(0, dtype=np.uint8), self.estimate(others)
        if not others:
            return self.add(keys), np.zeros(0, dtype=np.uint8)
        slots = self._slots([*keys, *others])
        counts = self.add_slots(slots[:, :n], n)
        theirs: np.ndarray = np.minimum.reduce(self._flat.take(slots[:, n:]))
        return counts, theirs

    def add_slots(self, slots: np.ndarray, n: int) -> np.ndarray:
        """`add` for `n` keys whose counters `_slots` has found."""
        flat = self._flat
        # saturating increment; duplicates within one batch count once
        bumped = _BUMPED.take(flat.take(slots))
        flat.put(slots, bumped)
        result: np.ndarray = np.minimum.reduce(bumped)
        self._added += n
        if self._added >= self.reset_every:
            self._table >>= 1
            self._added //= 2
            self.halvings += 1
        return result

    def estimate(self, keys: Sequence[bytes]) -> np.ndarray:
        """The estimated sightings of each key (uint8 array, len(keys))."""
        if not keys:
            return np.zeros(0, dtype=np.uint8)
        result: np.ndarray = np.minimum.reduce(self._flat.take(self._slots(keys)))
        return result


class ReuseAdmission:
    """Decides, per freshly stored block, whether a tier with `admission: reuse`
    (`admits`) or `tinylfu` (`admits_against`) should be written (see the module doc).
    Fed by every lookup (`sighted`)."""

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
        self._continued(keys, tail)
        return counts

    def _continued(self, keys: Sequence[bytes], tail: Sequence[bytes]) -> None:
        """Remember `tail` as continuing when the request's hit covered enough."""
        n, missed = len(keys), len(tail)
        if missed and n > missed and n - missed >= self.continuation_share * n:
            continuing = self._continuing
            for key in tail:
                continuing[key] = None
                continuing.move_to_end(key)
            while len(continuing) > self.max_continuing:
                continuing.popitem(last=False)

    def admits(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key: write it to the tier now?"""
        counts = self.sketch.estimate(keys)
        continuing = self._continuing
        need = self.min_sightings
        return [bool(c >= need) or key in continuing for key, c in zip(keys, counts.tolist())]

    def age_every(self, sightings: int) -> None:
        """Halve the sketch's counts every `sightings` (at least MIN_AGING_PERIOD)."""
        self.sketch.reset_every = max(MIN_AGING_PERIOD, sightings)

    def admits_against(
        self,
        keys: Sequence[bytes],
        free: int,
        candidates: Iterator[bytes],
        held_above: Callable[[bytes], bool] | None = None,
    ) -> list[bool]:
        """For each key: write it to a tier with room for `free` more blocks whose
        eviction would take `candidates` next (the `tinylfu` rule, see the module
        doc)? `held_above(key)`: the candidate is resident in the primary. Reads at
        most `len(keys) - free` candidates; a key past the room with no candidate
        left (the rest is claimed or being read) is declined: the tier would refuse it."""
        n = len(keys)
        if free >= n:
            return [True] * n
        free = max(0, free)
        past = list(keys[free:])
        rivals = list(islice(candidates, n - free))
        counts = self.sketch.estimate(past + rivals).tolist()  # one pass for both
        rival_counts = counts[len(past) :]
        continuing = self._continuing
        need = self.min_sightings
        verdicts = [True] * free
        j, left = 0, len(rivals)
        for key, count in zip(past, counts):
            if j < left and (
                count >= need
                or key in continuing
                or count > rival_counts[j]
                or (count and held_above is not None and held_above(rivals[j]))  # as 0
            ):
                verdicts.append(True)
                j += 1  # it displaces this candidate; the next key meets the next one
            else:
                verdicts.append(False)
        return verdicts
