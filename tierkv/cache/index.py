"""The cache's one authoritative per-key state.

For every key the cache knows about beyond the primary's own block table: which tiers
hold it (learnt from a confirmed store, a lookup answer, a tier's removal report),
which tiers failed to serve it (a claim not to believe again), which write-back tiers
it still has to reach (dirty), how many cascades carry it now, its hit count for
selective write-through, and the promotion it is part of.

One entry per key, packed into one int (tier bits: tier `i` is `1 << i`):

    bits  0..15  held       tiers believed to hold the key
    bits 16..31  lacking    tiers whose claim failed on load (until stored there again)
    bits 32..47  dirty      write-back tiers the key has yet to reach
    bits 48..63  cascading  cascade jobs carrying the key now
    bits 64..    hits       lookups that counted (one per request)

An int entry creates no object for the garbage collector to trace, which keeps
bookkeeping for a million keys flat. Short-lived attachments live beside the entry and
only while they exist: the promotion `Flight` a key is part of, failed write-back
attempts, and the last request that counted a hit. Entries that pin nothing (not
dirty, cascading or promoting) are forgotten oldest first past `limit`; a forgotten key
costs one more tier lookup.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable

import anyio

from tierkv.contract.keys import OffloadKey

MAX_TIERS = 16
_MASK = (1 << 16) - 1
_LACKING = 16
_DIRTY = 32
_CASCADING = 48
_HITS = 64
_ONE_CASCADE = 1 << _CASCADING
_ONE_HIT = 1 << _HITS


class Flight:
    """One promotion window several loads (and a prefetch) may wait on: single flight.

    It counts, per key, the waiters (whoever started the window counts as one; a load
    that finds the key in flight joins; one that gives up before the window lands
    leaves), records how each key's read ended, and when the window lands hands each
    waiter of a key that landed one reader on its block (`finish`), which the waiter
    takes with `take`. The counts live here, changed only through these methods, so
    every reader handed out is taken or given back exactly once."""

    __slots__ = ("_done", "_granted", "_outcome", "_waiters", "keys")

    def __init__(self, keys: list[OffloadKey]) -> None:
        self.keys = keys
        self._done = anyio.Event()
        self._waiters: dict[OffloadKey, int] = dict.fromkeys(keys, 1)  # the starter
        self._outcome: dict[OffloadKey, tuple[str | None, str | None]] = {}
        self._granted: dict[OffloadKey, int] = {}  # readers taken for waiters, not yet taken

    def __contains__(self, key: object) -> bool:
        """Whether `key` is one of the window's keys."""
        return key in self._waiters

    # -- waiters (before the window lands) -----------------------------------------------
    def join(self, key: OffloadKey) -> None:
        """One more waiter on `key`."""
        self._waiters[key] = self._waiters.get(key, 0) + 1

    def leave(self, key: OffloadKey) -> None:
        """A waiter on `key` gives up before the window lands: no reader for it."""
        self._waiters[key] -= 1

    def waiters(self, key: OffloadKey) -> int:
        """How many wait (or waited, once landed) on `key`."""
        return self._waiters.get(key, 0)

    # -- the read (stage 1) ----------------------------------------------------------------
    def served(self, key: OffloadKey, medium: str) -> None:
        """`key` was read from the tier `medium`."""
        self._outcome[key] = (medium, None)

    def failed(self, key: OffloadKey, error: str) -> None:
        """`key` could not be read, for `error`."""
        self._outcome[key] = (None, error)

    def read_keys(self) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """The keys read so far, and the rest (failed or not answered), in order."""
        outcome = self._outcome
        ok = [k for k in self.keys if outcome.get(k, (None, None))[0] is not None]
        rest = [k for k in self.keys if outcome.get(k, (None, None))[0] is None]
        return ok, rest

    def waiting(self) -> dict[OffloadKey, int]:
        """Key -> waiters, for the keys someone still waits on."""
        return {k: n for k, n in self._waiters.items() if n > 0}

    def finish(self, readers: dict[OffloadKey, int]) -> None:
        """The window landed: keys never answered are cancelled, and the waiters of
        each key read get the readers the primary gave them (`readers`, as `waiting`
        said when the blocks were made ready). Wakes every waiter."""
        for key in self.keys:
            self._outcome.setdefault(key, (None, "promotion cancelled"))
        for key, n in readers.items():
            if self._outcome.get(key, (None, None))[0] is not None:
                self._granted[key] = n
        self._done.set()

    # -- after it lands ------------------------------------------------------------------
    @property
    def landed(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> None:
        """Wait until the window has landed."""
        await self._done.wait()

    def take(self, key: OffloadKey) -> str | None:
        """A waiter's share of `key`: the tier it was read from, and one reader on its
        block that is now the caller's to give back; None when it was not read (see
        `error`) or no reader is left for it."""
        medium = self._outcome.get(key, (None, None))[0]
        if medium is None or self._granted.get(key, 0) <= 0:
            return None
        self._granted[key] -= 1
        return medium

    def error(self, key: OffloadKey) -> str:
        """Why `key` was not read (for a waiter `take` gave nothing)."""
        return self._outcome.get(key, (None, None))[1] or "promotion failed"


def lowest_bit(mask: int) -> int | None:
    """Index of the lowest set bit (the highest tier in the chain), or None."""
    return (mask & -mask).bit_length() - 1 if mask else None


class KeyIndex:
    """Key -> packed state, bounded; see the module docstring."""

    def __init__(self, limit: int) -> None:
        self._entries: OrderedDict[OffloadKey, int] = OrderedDict()
        self._dirty: dict[OffloadKey, None] = {}  # dirty keys, oldest first
        self._flights: dict[OffloadKey, Flight] = {}
        self._attempts: dict[OffloadKey, dict[int, int]] = {}
        self._requests: dict[OffloadKey, str] = {}
        self.limit = limit

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _set(self, key: OffloadKey, entry: int) -> None:
        entries = self._entries
        new = key not in entries
        entries[key] = entry
        if new and len(entries) > self.limit:
            self._trim()

    def _busy(self, key: OffloadKey, entry: int) -> bool:
        return bool((entry >> _DIRTY) & 0xFFFFFFFF) or key in self._flights

    def _trim(self) -> None:
        entries = self._entries
        for _ in range(min(64, len(entries))):
            if len(entries) <= self.limit:
                return
            key, entry = entries.popitem(last=False)
            if self._busy(key, entry):
                entries[key] = entry  # still in use: keep, look further
            else:
                self._requests.pop(key, None)

    # -- where a key is ---------------------------------------------------------------
    def held(self, key: OffloadKey) -> int:
        """Tier bits believed to hold `key` (claims that failed left out)."""
        entry = self._entries.get(key, 0)
        return entry & ~(entry >> _LACKING) & _MASK

    def location(self, key: OffloadKey) -> int | None:
        """The highest tier believed to hold `key`."""
        return lowest_bit(self.held(key))

    def note_held(self, keys: Iterable[OffloadKey], tier: int) -> None:
        bit = 1 << tier
        get = self._entries.get
        for key in keys:
            self._set(key, (get(key, 0) | bit) & ~(bit << _LACKING))

    def note_missing(self, key: OffloadKey, tier: int) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries[key] = entry & ~(1 << tier)

    def note_failed(self, key: OffloadKey, tier: int) -> None:
        """`tier` could not serve `key`: do not believe its claim again."""
        bit = 1 << tier
        self._set(key, (self._entries.get(key, 0) & ~bit) | (bit << _LACKING))

    def believes(self, key: OffloadKey, tier: int) -> bool:
        return not (self._entries.get(key, 0) >> (_LACKING + tier)) & 1

    # -- cascades and promotions ----------------------------------------------------------
    def add_cascading(self, keys: Iterable[OffloadKey], delta: int) -> None:
        """One more (delta 1) or one fewer (delta -1) cascade carries each key."""
        get = self._entries.get
        for key in keys:
            entry = get(key, 0)
            if delta < 0 and not (entry >> _CASCADING) & _MASK:
                continue
            self._set(key, entry + delta * _ONE_CASCADE)

    def cascading(self, key: OffloadKey) -> int:
        return (self._entries.get(key, 0) >> _CASCADING) & _MASK

    def flight(self, key: OffloadKey) -> Flight | None:
        return self._flights.get(key)

    def set_flight(self, key: OffloadKey, flight: Flight) -> None:
        self._flights[key] = flight
        if key not in self._entries:
            self._set(key, 0)

    def end_flight(self, key: OffloadKey, flight: Flight) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]

    @property
    def promoting(self) -> int:
        return len(self._flights)

    # -- selective write-through ------------------------------------------------------------
    def count_hit(self, key: OffloadKey, request_id: str | None) -> int | None:
        """Count a hit (once per request id; every call when None). The new count, or
        None when this request already counted."""
        if request_id is not None:
            if self._requests.get(key) == request_id:
                return None
            self._requests[key] = request_id
        entry = self._entries.get(key, 0) + _ONE_HIT
        self._set(key, entry)
        return entry >> _HITS

    def count_hits(
        self, keys: Iterable[OffloadKey], request_id: str | None
    ) -> list[tuple[OffloadKey, int]]:
        """`count_hit` over `keys`; (key, new count) for the keys that counted."""
        if request_id is not None:
            counted = [(k, n) for k in keys if (n := self.count_hit(k, request_id)) is not None]
            return counted
        entries, get, limit = self._entries, self._entries.get, self.limit
        out: list[tuple[OffloadKey, int]] = []
        append = out.append
        for key in keys:
            entry = get(key)
            if entry is None:
                self._set(key, _ONE_HIT)
                append((key, 1))
            else:
                entry += _ONE_HIT
                entries[key] = entry
                append((key, entry >> _HITS))
        if len(entries) > limit:
            self._trim()
        return out

    def hits(self, key: OffloadKey) -> int:
        return self._entries.get(key, 0) >> _HITS

    def with_hits(self, keys: Iterable[OffloadKey], need: int) -> list[OffloadKey]:
        """The keys of `keys` counted at least `need` hits, in order (one probe each)."""
        get = self._entries.get
        return [k for k in keys if get(k, 0) >> _HITS >= need]

    # -- write-back ----------------------------------------------------------------------
    @property
    def dirty_count(self) -> int:
        return len(self._dirty)

    def dirty_keys(self) -> list[OffloadKey]:
        """Every dirty key, oldest first. O(dirty): for flush and close, not per batch."""
        return list(self._dirty)

    def oldest_dirty(self, n: int, skip: Container[OffloadKey] = ()) -> list[OffloadKey]:
        """The `n` oldest dirty keys not in `skip`, walking only as far as needed
        (O(n + skipped)): the write-back loop takes its batches this way."""
        out: list[OffloadKey] = []
        if n <= 0:
            return out
        for key in self._dirty:
            if key not in skip:
                out.append(key)
                if len(out) == n:
                    break
        return out

    def is_dirty(self, key: OffloadKey) -> bool:
        return key in self._dirty

    def is_clean(self, key: OffloadKey) -> bool:
        return key not in self._dirty

    def mark_dirty(self, key: OffloadKey, tiers: int) -> None:
        if tiers:
            self._set(key, self._entries.get(key, 0) | ((tiers & _MASK) << _DIRTY))
            self._dirty[key] = None

    def clean(self, key: OffloadKey, tier: int) -> None:
        entry = self._entries.get(key, 0) & ~(1 << (_DIRTY + tier))
        if key in self._entries:
            self._entries[key] = entry
        attempts = self._attempts.get(key)
        if attempts is not None:
            attempts.pop(tier, None)
        if not (entry >> _DIRTY) & _MASK:
            self._dirty.pop(key, None)
            self._attempts.pop(key, None)

    def pending_for(self, key: OffloadKey, tier: int) -> bool:
        return bool((self._entries.get(key, 0) >> (_DIRTY + tier)) & 1)

    def failed_write_back(self, key: OffloadKey, tier: int) -> int:
        """Count a failed write-back of `key` to `tier`; the attempts so far."""
        attempts = self._attempts.setdefault(key, {})
        attempts[tier] = attempts.get(tier, 0) + 1
        return attempts[tier]

    # -- introspection --------------------------------------------------------------------
    def known_keys(self) -> list[OffloadKey]:
        return list(self._entries)
