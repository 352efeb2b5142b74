"""Adaptive replacement cache (Megiddo & Modha, FAST '03), adapted to a slab whose
entries may be temporarily unevictable.

T1 holds keys seen once, T2 keys seen again; B1 and B2 remember keys recently evicted
from each (ghosts, no data). A new key whose ghost is in B1 says "T1 was too small":
the target size `p` of T1 grows; a ghost hit in B2 shrinks it. Victims come from T1
while it is larger than `p`, else from T2; when the preferred list has nothing
evictable, the other list gives. Ghost lists are bounded as in the paper:
|T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.

A pinned key (being written or read) leaves its list for a side table that remembers
which list it belongs to; sizes |T1| and |T2| still count it. Unpinned, it re-enters
its list as most recent, so victims are found without walking pinned keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from tierkv.contract.keys import OffloadKey
from tierkv.policies.base import CanEvict, EvictionPolicy

_List = OrderedDict[OffloadKey, None]


class ARCPolicy(EvictionPolicy):
    """ARC over the primary's slots; see the module docstring."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: _List = OrderedDict()
        self._t2: _List = OrderedDict()
        self._b1: _List = OrderedDict()
        self._b2: _List = OrderedDict()
        self._pinned: dict[OffloadKey, bool] = {}  # key -> belongs to T2
        self._pinned_t1 = 0
        self._p = 0.0

    # -- introspection ------------------------------------------------------------
    @property
    def target(self) -> float:
        """The adaptive target size of T1."""
        return self._p

    @property
    def t1(self) -> list[OffloadKey]:
        return [*self._t1, *(k for k, in_t2 in self._pinned.items() if not in_t2)]

    @property
    def t2(self) -> list[OffloadKey]:
        return [*self._t2, *(k for k, in_t2 in self._pinned.items() if in_t2)]

    def _t1_size(self) -> int:
        return len(self._t1) + self._pinned_t1

    def _t2_size(self) -> int:
        return len(self._t2) + len(self._pinned) - self._pinned_t1

    @property
    def b1(self) -> list[OffloadKey]:
        return list(self._b1)

    @property
    def b2(self) -> list[OffloadKey]:
        return list(self._b2)

    # -- policy -------------------------------------------------------------------
    def _adapted_target(self, new_keys: Sequence[OffloadKey]) -> float:
        p = self._p
        b1, b2 = len(self._b1), len(self._b2)
        for key in new_keys:
            if key in self._b1 and b1:
                p = min(float(self.capacity), p + max(b2 / b1, 1.0))
                b1 -= 1
            elif key in self._b2 and b2:
                p = max(0.0, p - max(b1 / b2, 1.0))
                b2 -= 1
        return p

    def _victims(self, p: float, can_evict: CanEvict) -> Iterator[tuple[OffloadKey, bool]]:
        """Yield (key, from_t1) in eviction order for target `p`, without mutating."""
        t1_left = self._t1_size()
        it1 = (k for k in self._t1 if can_evict(k))
        it2 = (k for k in self._t2 if can_evict(k))
        while True:
            prefer_t1 = t1_left > 0 and t1_left > p
            first, second = (it1, it2) if prefer_t1 else (it2, it1)
            key = next(first, None)
            from_t1 = prefer_t1
            if key is None:
                key = next(second, None)
                from_t1 = not prefer_t1
            if key is None:
                return
            if from_t1:
                t1_left -= 1
            yield key, from_t1

    def candidates(self, limit: int, can_evict: CanEvict) -> list[OffloadKey]:
        found: list[OffloadKey] = []
        if limit <= 0:
            return found
        for key, _ in self._victims(self._p, can_evict):
            found.append(key)
            if len(found) == limit:
                break
        return found

    def pin(self, key: OffloadKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._pinned[key] = False
            self._pinned_t1 += 1
        elif key in self._t2:
            del self._t2[key]
            self._pinned[key] = True

    def unpin(self, key: OffloadKey) -> None:
        in_t2 = self._pinned.pop(key, None)
        if in_t2 is None:
            return
        if in_t2:
            self._t2[key] = None
        else:
            self._pinned_t1 -= 1
            self._t1[key] = None

    def _pick(self, p: float, limit: int, can_evict: CanEvict) -> list[tuple[OffloadKey, bool]]:
        chosen: list[tuple[OffloadKey, bool]] = []
        if limit > 0:
            for pick in self._victims(p, can_evict):
                chosen.append(pick)
                if len(chosen) == limit:
                    break
        return chosen

    def admit(
        self,
        new_keys: Sequence[OffloadKey],
        num_victims: int,
        can_evict: CanEvict,
        *,
        pinned: bool = False,
    ) -> list[OffloadKey] | None:
        p = self._adapted_target(new_keys)
        chosen = self._pick(p, num_victims, can_evict)
        if len(chosen) < max(num_victims, 0):
            return None
        self._commit(p, chosen, new_keys, pinned)
        return [key for key, _ in chosen]

    def admit_prefix(
        self,
        new_keys: Sequence[OffloadKey],
        free: int,
        can_evict: CanEvict,
        *,
        pinned: bool = False,
    ) -> tuple[list[OffloadKey], list[OffloadKey]]:
        p = self._adapted_target(new_keys)
        chosen = self._pick(p, len(new_keys) - free, can_evict)
        admitted = list(new_keys[: free + len(chosen)])
        self._commit(self._adapted_target(admitted), chosen, admitted, pinned)
        return admitted, [key for key, _ in chosen]

    def _commit(
        self,
        p: float,
        chosen: Sequence[tuple[OffloadKey, bool]],
        new_keys: Sequence[OffloadKey],
        pinned: bool,
    ) -> None:
        self._p = p
        for key, from_t1 in chosen:
            if from_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        for key in new_keys:
            if key in self._t1 or key in self._t2 or key in self._pinned:
                self.touch([key])
            elif key in self._b1 or key in self._b2:
                self._b1.pop(key, None)
                self._b2.pop(key, None)
                self._t2[key] = None
            else:
                self._t1[key] = None
            if pinned:
                self.pin(key)
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        t1, t2 = self._t1_size(), self._t2_size()
        while self._b1 and t1 + len(self._b1) > c:
            self._b1.popitem(last=False)
        while (self._b1 or self._b2) and (t1 + t2 + len(self._b1) + len(self._b2) > 2 * c):
            (self._b2 if self._b2 else self._b1).popitem(last=False)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in reversed(list(keys)):
            if key in self._t1:
                del self._t1[key]
                self._t2[key] = None
            elif key in self._t2:
                self._t2.move_to_end(key)
            elif self._pinned.get(key) is False:
                self._pinned[key] = True
                self._pinned_t1 -= 1

    def discard(self, key: OffloadKey) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)
        if self._pinned.pop(key, None) is False:
            self._pinned_t1 -= 1

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2 or key in self._pinned

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._pinned)

    def eviction_order(self) -> list[OffloadKey]:
        order = [key for key, _ in self._victims(self._p, lambda _k: True)]
        return [*order, *self._pinned]
