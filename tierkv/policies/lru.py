"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tierkv.keys import OffloadKey
from tierkv.policies.base import CanEvict, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the evictable key used longest ago. New keys enter as most recent."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()  # oldest first

    def admit(
        self, new_keys: Sequence[OffloadKey], num_victims: int, can_evict: CanEvict
    ) -> list[OffloadKey] | None:
        victims: list[OffloadKey] = []
        if num_victims > 0:
            for key in self._order:
                if can_evict(key):
                    victims.append(key)
                    if len(victims) == num_victims:
                        break
            if len(victims) < num_victims:
                return None
        for key in victims:
            del self._order[key]
        for key in new_keys:
            self._order[key] = None
            self._order.move_to_end(key)
        return victims

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in reversed(list(keys)):
            if key in self._order:
                self._order.move_to_end(key)

    def discard(self, key: OffloadKey) -> None:
        self._order.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def eviction_order(self) -> list[OffloadKey]:
        return list(self._order)
