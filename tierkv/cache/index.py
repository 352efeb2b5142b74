"""The cache's one authoritative per-key state.

For every key the cache knows about beyond the primary's own block table: which tiers
hold it (learnt from a confirmed store, a lookup answer, a tier's removal report),
which tiers failed to serve it (a claim not to believe again), which write-back tiers
it still has to reach (dirty), how many cascades carry it now, the promotion it is
part of, and its hit count for selective write-through. Tiers are bits (tier `i` is
`1 << i`), so a state is a handful of ints.

States that pin nothing (not dirty, not promoting, not cascading) are forgotten
oldest first past `limit`; a forgotten key simply costs one more tier lookup.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import anyio

from tierkv.keys import OffloadKey


@dataclass
class Flight:
    """One promotion window several loads may wait on (single flight)."""

    keys: list[OffloadKey]
    done: anyio.Event = field(default_factory=anyio.Event)
    waiters: dict[OffloadKey, int] = field(default_factory=dict)
    outcome: dict[OffloadKey, tuple[str | None, str | None]] = field(default_factory=dict)
    granted: dict[OffloadKey, int] = field(default_factory=dict)  # readers taken for waiters


@dataclass(slots=True)
class KeyState:
    held: int = 0  # tiers known to hold the key
    lacking: int = 0  # tiers whose claim failed on load: not believed until re-stored
    dirty: int = 0  # write-back tiers the key has yet to reach
    attempts: dict[int, int] | None = None  # failed write-backs per tier index
    cascading: int = 0  # cascade jobs carrying the key now
    flight: Flight | None = None
    hits: int = 0
    last_request: str | None = None

    def busy(self) -> bool:
        return bool(self.dirty or self.cascading or self.flight is not None)


def lowest_bit(mask: int) -> int | None:
    """Index of the lowest set bit (the highest tier in the chain), or None."""
    return (mask & -mask).bit_length() - 1 if mask else None


class KeyIndex:
    """Key -> `KeyState`, bounded; plus the ordered set of dirty keys."""

    def __init__(self, limit: int) -> None:
        self._states: OrderedDict[OffloadKey, KeyState] = OrderedDict()
        self._dirty: dict[OffloadKey, None] = {}  # insertion order: oldest first
        self.limit = limit

    def __len__(self) -> int:
        return len(self._states)

    def get(self, key: OffloadKey) -> KeyState | None:
        return self._states.get(key)

    def state(self, key: OffloadKey) -> KeyState:
        """The key's state, created (as most recent) if new."""
        st = self._states.get(key)
        if st is None:
            st = self._states[key] = KeyState()
            if len(self._states) > self.limit:
                self._trim()
        return st

    def _trim(self) -> None:
        for _ in range(min(64, len(self._states))):
            if len(self._states) <= self.limit:
                return
            key, st = self._states.popitem(last=False)
            if st.busy():
                self._states[key] = st  # still in use: keep, look further

    def items(self) -> Iterator[tuple[OffloadKey, KeyState]]:
        return iter(list(self._states.items()))

    # -- where a key is ---------------------------------------------------------------
    def location(self, key: OffloadKey) -> int | None:
        """The highest tier believed to hold `key`."""
        st = self._states.get(key)
        return None if st is None else lowest_bit(st.held & ~st.lacking)

    def note_held(self, keys: Iterable[OffloadKey], tier: int) -> None:
        bit = 1 << tier
        for key in keys:
            st = self.state(key)
            st.held |= bit
            st.lacking &= ~bit

    def note_missing(self, key: OffloadKey, tier: int) -> None:
        st = self._states.get(key)
        if st is not None:
            st.held &= ~(1 << tier)

    def note_failed(self, key: OffloadKey, tier: int) -> None:
        """`tier` could not serve `key`: do not believe its claim again."""
        st = self.state(key)
        st.held &= ~(1 << tier)
        st.lacking |= 1 << tier

    def believes(self, key: OffloadKey, tier: int) -> bool:
        st = self._states.get(key)
        return st is None or not (st.lacking >> tier) & 1

    # -- write-back ----------------------------------------------------------------------
    @property
    def dirty_count(self) -> int:
        return len(self._dirty)

    def dirty_keys(self) -> list[OffloadKey]:
        return list(self._dirty)

    def is_dirty(self, key: OffloadKey) -> bool:
        return key in self._dirty

    def is_clean(self, key: OffloadKey) -> bool:
        return key not in self._dirty

    def mark_dirty(self, key: OffloadKey, tiers: int) -> None:
        st = self.state(key)
        st.dirty |= tiers
        if st.dirty:
            self._dirty[key] = None

    def clean(self, key: OffloadKey, tier: int) -> None:
        st = self._states.get(key)
        if st is None:
            self._dirty.pop(key, None)
            return
        st.dirty &= ~(1 << tier)
        if st.attempts:
            st.attempts.pop(tier, None)
        if not st.dirty:
            st.attempts = None
            self._dirty.pop(key, None)

    def pending_for(self, key: OffloadKey, tier: int) -> bool:
        st = self._states.get(key)
        return st is not None and bool((st.dirty >> tier) & 1)
