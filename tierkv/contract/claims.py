"""Claims: blocks a lookup reported, kept from the tier's own eviction until loaded.

A lookup that reports a block held is a promise: the request will load it next. A tier
that evicts by itself (a capacity LRU) could otherwise drop the block between the
lookup and the load, when a store running meanwhile needs room, and the promised hit
becomes a miss. So the cache *claims* the blocks of a hit in the tier that will serve
them (`SecondaryTierManager.protect`) and lets the claim go once the request's load has
read them (`unprotect`). A claim is never held for ever: each carries a lease (seconds)
and lapses when it runs out, whether or not it was let go.

`ClaimTable` is the bookkeeping a tier keeps for that, so a tier that declares
`protects_claims` only has to ask `is_protected(key)` in its eviction and pass over
the keys it names. Claims are counted per key (several requests may claim one block;
it stays protected while any claim of it lives), anonymous (an `unprotect` lets go of
one live claim of the key: the one that runs out first), and safe from any thread (a
tier may evict inside a worker thread, as the sqlite plugin does).
"""

from __future__ import annotations

import bisect
import heapq
import threading
import time
from collections.abc import Callable, Iterable

from tierkv.contract.keys import OffloadKey

__all__ = ["ClaimTable"]


class ClaimTable:
    """Live claims per key, each with the monotonic time its lease runs out.

    `expired` counts claims whose lease ran out before they were let go; they are
    dropped when next seen (a check of their key, or any `protect`, which sweeps the
    claims that ran out), so the table never holds more than the claims of the last
    lease's worth of lookups."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._deadlines: dict[OffloadKey, list[float]] = {}  # per key, ascending
        # heap: when to look again at each `protect` call's keys (one entry per call,
        # not per key: a lookup's hit of thousands of blocks pushes once)
        self._expiry: list[tuple[float, int, tuple[OffloadKey, ...]]] = []
        self._calls = 0
        self.expired = 0

    def __len__(self) -> int:
        """Keys with at least one claim not yet let go (some may have run out unseen)."""
        return len(self._deadlines)

    def protect(self, keys: Iterable[OffloadKey], lease: float) -> None:
        """One more claim on each of `keys`, for `lease` seconds from now."""
        now = self._clock()
        deadline = now + lease
        keys = tuple(keys)
        with self._lock:
            self._sweep(now)
            if lease <= 0 or not keys:
                return
            deadlines = self._deadlines
            for key in keys:
                held = deadlines.get(key)
                if held is None:
                    deadlines[key] = [deadline]
                else:
                    bisect.insort(held, deadline)
            self._calls += 1
            heapq.heappush(self._expiry, (deadline, self._calls, keys))

    def unprotect(self, keys: Iterable[OffloadKey]) -> None:
        """Let go of one live claim on each of `keys` (the one that would run out
        first; those already run out are counted expired first); keys with no live
        claim are ignored."""
        now = self._clock()
        with self._lock:
            deadlines = self._deadlines
            for key in keys:
                held = deadlines.get(key)
                if not held:
                    continue
                while held and held[0] <= now:
                    del held[0]
                    self.expired += 1
                if held:
                    del held[0]
                if not held:
                    del deadlines[key]

    def is_protected(self, key: OffloadKey) -> bool:
        """Whether a claim on `key` is still live: eviction must pass over it."""
        if key not in self._deadlines:  # most keys: no lock (one dict read is atomic)
            return False
        with self._lock:
            held = self._deadlines.get(key)
            if not held:
                return False
            if held[-1] > self._clock():
                return True
            self.expired += len(held)  # every claim on it ran out unreleased
            del self._deadlines[key]
            return False

    def sweep(self) -> int:
        """Drop the claims whose lease has run out; how many claims are left."""
        with self._lock:
            self._sweep(self._clock())
            return sum(len(held) for held in self._deadlines.values())

    def clear(self) -> None:
        """Forget every claim (the tier closed: nothing is evicted any more)."""
        with self._lock:
            self._deadlines.clear()
            self._expiry.clear()

    def _sweep(self, now: float) -> None:
        """Under the lock: count and drop the claims that ran out by `now`. Each claim
        is named by one heap entry (its `protect` call's); for a key whose claim was let
        go the entry finds a later deadline (or none) first in its list and drops
        nothing."""
        expiry, deadlines = self._expiry, self._deadlines
        while expiry and expiry[0][0] <= now:
            _, _, keys = heapq.heappop(expiry)
            for key in keys:
                held = deadlines.get(key)
                if held and held[0] <= now:
                    del held[0]
                    self.expired += 1
                    if not held:
                        del deadlines[key]
