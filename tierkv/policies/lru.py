"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tierkv.keys import OffloadKey
from tierkv.policies.base import CanEvict, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the evictable key used longest ago. New keys enter as most recent; a
    pinned key waits apart and re-enters as most recent when unpinned."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()  # unpinned, oldest first
        self._pinned: dict[OffloadKey, None] = {}

    def candidates(self, limit: int, can_evict: CanEvict) -> list[OffloadKey]:
        found: list[OffloadKey] = []
        if limit <= 0:
            return found
        for key in self._order:
            if can_evict(key):
                found.append(key)
                if len(found) == limit:
                    break
        return found

    def admit(
        self,
        new_keys: Sequence[OffloadKey],
        num_victims: int,
        can_evict: CanEvict,
        *,
        pinned: bool = False,
    ) -> list[OffloadKey] | None:
        victims = self.candidates(num_victims, can_evict)
        if len(victims) < max(num_victims, 0):
            return None
        self._commit(victims, new_keys, pinned)
        return victims

    def admit_prefix(
        self,
        new_keys: Sequence[OffloadKey],
        free: int,
        can_evict: CanEvict,
        *,
        pinned: bool = False,
    ) -> tuple[list[OffloadKey], list[OffloadKey]]:
        victims = self.candidates(len(new_keys) - free, can_evict)
        admitted = list(new_keys[: free + len(victims)])
        self._commit(victims, admitted, pinned)
        return admitted, victims

    def _commit(
        self, victims: Sequence[OffloadKey], new_keys: Sequence[OffloadKey], pinned: bool
    ) -> None:
        order = self._order
        for key in victims:
            del order[key]
        if pinned:
            held = self._pinned
            for key in new_keys:
                if key not in order:
                    held[key] = None
            return
        for key in new_keys:
            if key in self._pinned:
                continue
            order[key] = None
            order.move_to_end(key)

    def pin(self, key: OffloadKey) -> None:
        if self._order.pop(key, 0) is None:
            self._pinned[key] = None

    def unpin(self, key: OffloadKey) -> None:
        if key in self._pinned:
            del self._pinned[key]
            self._order[key] = None

    def unpin_many(self, keys: Iterable[OffloadKey]) -> None:
        pinned, order = self._pinned, self._order
        for key in keys:
            if key in pinned:
                del pinned[key]
                order[key] = None

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in reversed(list(keys)):
            if key in self._order:
                self._order.move_to_end(key)

    def discard(self, key: OffloadKey) -> None:
        self._order.pop(key, None)
        self._pinned.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pinned

    def __len__(self) -> int:
        return len(self._order) + len(self._pinned)

    def eviction_order(self) -> list[OffloadKey]:
        return [*self._order, *self._pinned]
