"""The eviction-policy interface the primary tier drives.

A policy only orders keys. The primary tells it which resident keys are pinned
(being written or read: `pin`/`unpin`); a policy keeps pinned keys out of its victim
order, so choosing a victim never walks past them (O(1) per victim however many blocks
are held). A caller may still veto candidates with a predicate (keys of the request
being stored, dirty write-back blocks); that walk is bounded by what it vetoes, and
when nothing is vetoed (`evict_any`) a policy may skip the predicate altogether.
`admit` is all-or-nothing: it either finds every victim it was asked for and commits
(victims out, new keys in), or returns None and changes nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

from tierkv.contract.keys import OffloadKey

CanEvict = Callable[[OffloadKey], bool]


def evict_any(key: OffloadKey) -> bool:
    """The predicate that vetoes nothing. A policy may recognise it (`is evict_any`)
    and take its next victims without calling it per key."""
    return True


class EvictionPolicy(ABC):
    """Orders resident keys for eviction. Not thread-safe; the primary owns it."""

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"policy capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def admit(
        self,
        new_keys: Sequence[OffloadKey],
        num_victims: int,
        can_evict: CanEvict,
        *,
        pinned: bool = False,
    ) -> list[OffloadKey] | None:
        """Evict `num_victims` keys for which `can_evict` holds, then make `new_keys`
        resident (pinned at once with `pinned`: they are being written). `new_keys`
        are not resident (the primary admits only keys it lacks). Return the
        victims in eviction order, or None (and change nothing) when fewer than
        `num_victims` evictable keys exist."""

    @abstractmethod
    def admit_prefix(
        self,
        new_keys: Sequence[OffloadKey],
        free: int,
        can_evict: CanEvict,
        *,
        pinned: bool = False,
    ) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """Admit the longest prefix of `new_keys` that `free` slots plus victims can
        hold (one walk of the victim order). Returns (admitted keys, victims)."""

    @abstractmethod
    def candidates(self, limit: int, can_evict: CanEvict) -> list[OffloadKey]:
        """Up to `limit` unpinned keys for which `can_evict` holds, next victim first.
        Changes nothing."""

    @abstractmethod
    def pin(self, key: OffloadKey) -> None:
        """Take a resident key out of the victim order until `unpin` (it is being
        written or read). Unknown or already pinned keys are ignored."""

    @abstractmethod
    def unpin(self, key: OffloadKey) -> None:
        """Put a pinned key back into the victim order, as most recently used."""

    def unpin_many(self, keys: Iterable[OffloadKey]) -> None:
        """`unpin` each key, in order."""
        for key in keys:
            self.unpin(key)

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Record a use of resident `keys`; the first key ends the most recent.
        Keys that are not resident are ignored."""

    @abstractmethod
    def discard(self, key: OffloadKey) -> None:
        """Forget a resident key without counting it as an eviction (a failed write,
        an explicit removal). Unknown keys are ignored."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def eviction_order(self) -> list[OffloadKey]:
        """Resident keys, next victim first (unpinned keys, then pinned ones). For
        tests and introspection; O(n)."""
