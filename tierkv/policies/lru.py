"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice

from tierkv.contract.keys import OffloadKey
from tierkv.policies.base import CanEvict, EvictionPolicy, evict_any


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
        if can_evict is evict_any:  # the oldest `limit`, at C speed
            return list(islice(self._order, limit))
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
            self._pinned.update(dict.fromkeys(new_keys))  # new: not in the order
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
        pop = self._pinned.pop
        self._order.update(dict.fromkeys([k for k in keys if pop(k, 0) is None]))

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        move = self._order.move_to_end  # one probe per key; pinned keys are not there
        for key in reversed(keys if isinstance(keys, Sequence) else list(keys)):
            try:  # noqa: SIM105 (suppress() costs a context manager per key)
                move(key)
            except KeyError:
                pass

    def discard(self, key: OffloadKey) -> None:
        self._order.pop(key, None)
        self._pinned.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pinned

    def __len__(self) -> int:
        return len(self._order) + len(self._pinned)

    def eviction_order(self) -> list[OffloadKey]:
        return [*self._order, *self._pinned]
