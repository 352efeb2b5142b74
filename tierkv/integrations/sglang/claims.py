"""Which `batch_exists` calls claimed a region, until the load that reads it.

SGLang asks `batch_exists` for a request's pages, and a little later its prefetch
thread reads the pages it was told are there (`batch_get_v1` / `_v2`). Nothing names
the request in either call, so each `batch_exists` call claims its hits in their tiers
under an owner of its own (`tierkv.driver.claims`: a tier that evicts by itself keeps
a claimed block until the claim ends), and this table remembers, per region key, the
owners that claimed it. The load of a key ends those claims, read or not; a claim no
load ends (SGLang did not fetch the pages after all) ends with its tier's
`claim_lease`. The table is bounded: past `limit` keys the oldest are forgotten, their
claims left to the lease. Thread-safe (SGLang calls from its scheduler and its
prefetch and I/O threads).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from tierkv.contract.keys import OffloadKey

__all__ = ["ExistsClaims"]

REMEMBERED_KEYS = 1 << 16
"""Region keys whose claiming owners are remembered at most (a 128-page exists call of
an MHA page_first pool claims 256)."""


class ExistsClaims:
    """Per region key, the owners (exists calls) whose claims wait for its load."""

    def __init__(self, limit: int = REMEMBERED_KEYS) -> None:
        self._limit = limit
        self._owners: OrderedDict[OffloadKey, list[str]] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, owner: str, keys: Sequence[OffloadKey]) -> None:
        """`owner` claimed `keys` (the hits of its lookup)."""
        with self._lock:
            for key in keys:
                owners = self._owners.setdefault(key, [])
                owners.append(owner)
                self._owners.move_to_end(key)
            while len(self._owners) > self._limit:
                self._owners.popitem(last=False)  # its claims end with their lease

    def ending(self, keys: Sequence[OffloadKey]) -> dict[str, list[OffloadKey]]:
        """Forget `keys` (their load is over) and return the claims to end: owner ->
        its keys among them."""
        ending: dict[str, list[OffloadKey]] = {}
        with self._lock:
            for key in keys:
                for owner in self._owners.pop(key, ()):
                    ending.setdefault(owner, []).append(key)
        return ending

    def forget(self, owner: str, keys: Sequence[OffloadKey]) -> None:
        """`owner`'s claims on `keys` end without a load (pages SGLang will not fetch)."""
        with self._lock:
            for key in keys:
                owners = self._owners.get(key)
                if owners and owner in owners:
                    owners.remove(owner)
                    if not owners:
                        del self._owners[key]

    def __len__(self) -> int:
        return len(self._owners)

    def __bool__(self) -> bool:
        """Whether any key is claimed (a load with none skips `ending`)."""
        return bool(self._owners)
