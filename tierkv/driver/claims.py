"""`ClaimLedger`: which request holds which claims, so each ends exactly once.

A lookup that finds blocks in a tier claims them there (`GuardedTier.protect`, which
the tier keeps from its own eviction: `tierkv.contract.claims`) the moment the tier
answers, before anything else can run; once the hit is known, the claims it needs
are kept under the request (its `request_id`) and the rest let go at once. The
request's load lets its claims go when it ends (read, failed, cancelled), as does the
end of the request (`TieredCache.end_request`); a request's next lookup replaces its
claims (the new ones are taken before the old ones end, so nothing is unprotected in
between). Whatever happens, a claim ends exactly once: let go while its lease lasts,
or counted `lease_expired` (the tier has dropped or will drop it itself: no call is
needed, and none could reach a claim that is gone).

A lookup without a request id is as safe (`anonymous`): its claims are kept under an
owner of their own, and a load without a request id ends, for each key it loads, the
oldest such claim on that key (the lookup whose hit it is serving); the lease bounds
the rest. A server that passes no request ids keeps every hit it was told of.

Lives in the driver, beside `GuardedTier`, so an engine adapter's lookup-and-lock
(LMCache's L2) keeps claims by the same rules as the cache. Not thread-safe: call it
from the loop that runs the tiers.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from tierkv.contract.keys import OffloadKey
from tierkv.driver.guarded import GuardedTier

__all__ = ["ANONYMOUS", "ClaimLedger", "Taken"]

ANONYMOUS = "\0lookup:"
"""Prefix of the owners of lookups without a request id (no request id starts so)."""


@dataclass
class Taken:
    """Claims on `keys` in tier `tier`, lasting until `deadline` (monotonic seconds;
    taken before the tier's own clock started, so never later than the tier's)."""

    tier: int
    keys: set[OffloadKey]
    deadline: float


class ClaimLedger:
    """Claims per owner (a request id) and tier; see the module docstring."""

    def __init__(
        self,
        tiers: Sequence[GuardedTier] | Mapping[int, GuardedTier],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`tiers[i]` is the tier of index `i` (a mapping where an adapter drives one
        tier of a longer chain, such as vLLM's secondary tier `i`)."""
        self._tiers = tiers
        self._clock = clock
        # owner -> tier index -> its claims there; oldest owner first (swept from there)
        self._owners: OrderedDict[str, dict[int, Taken]] = OrderedDict()
        # key -> anonymous owners that kept a claim on it, oldest first
        self._anonymous: dict[OffloadKey, deque[str]] = {}
        self._lookups = itertools.count(1)

    def anonymous(self) -> str:
        """A fresh owner for one lookup without a request id (see the module
        docstring): its claims end with the loads of their keys, or their lease."""
        return f"{ANONYMOUS}{next(self._lookups)}"

    def let_go_loaded(self, keys: Iterable[OffloadKey]) -> int:
        """A load without a request id read (or tried) `keys`: end, per key, the
        oldest anonymous claim on it. How many claims ended."""
        ended = 0
        anonymous = self._anonymous
        for key in keys:
            owners = anonymous.get(key)
            while owners:
                owner = owners.popleft()
                held = self._owners.get(owner)
                if held is not None and any(key in c.keys for c in held.values()):
                    ended += self.let_go(owner, (key,))
                    break
            if owners is not None and not owners:
                del anonymous[key]
        return ended

    def __len__(self) -> int:
        """Owners holding claims."""
        return len(self._owners)

    def held(self, owner: str) -> dict[int, set[OffloadKey]]:
        """Tier index -> keys `owner` holds claimed there (a copy)."""
        return {t: set(c.keys) for t, c in self._owners.get(owner, {}).items()}

    def take(self, handle: GuardedTier, keys: Sequence[OffloadKey]) -> Taken | None:
        """Claim `keys` in `handle`'s tier now (it just reported them held). None when
        the tier takes no claims."""
        lease = handle.claim_lease
        if not lease or not keys:
            return None
        deadline = self._clock() + lease
        if not handle.protect(keys, lease):
            return None
        return Taken(handle.index, set(keys), deadline)

    def keep(self, owner: str, taken: Iterable[Taken], needed: Mapping[OffloadKey, int]) -> None:
        """Of the claims one lookup `taken`, keep under `owner` those its hit reads
        (`needed`: key -> the tier it is read from) and let go the rest; then let go
        what `owner` held before (this lookup replaces it)."""
        kept: dict[int, Taken] = {}
        for claim in taken:
            mine = {k for k in claim.keys if needed.get(k) == claim.tier}
            extra = claim.keys - mine
            if extra:
                self._tiers[claim.tier].unprotect(list(extra))
            if not mine:
                continue
            already = kept.get(claim.tier)
            if already is None:
                kept[claim.tier] = Taken(claim.tier, mine, claim.deadline)
            else:  # the tier was asked twice (a second round): both lasts as the first
                self._tiers[claim.tier].unprotect(list(mine & already.keys))
                already.keys |= mine
                already.deadline = min(already.deadline, claim.deadline)
        before = self._owners.pop(owner, None)
        if kept:
            self._owners[owner] = kept
            if owner.startswith(ANONYMOUS):
                for claim in kept.values():
                    for key in claim.keys:
                        self._anonymous.setdefault(key, deque()).append(owner)
        if before:
            self._end(before.values(), None)
        self.sweep()

    def drop(self, taken: Iterable[Taken]) -> None:
        """Let go of claims a lookup took and will not keep (it failed or was cancelled
        before its hit was known)."""
        self._end(taken, None)

    def let_go(self, owner: str | None, keys: Iterable[OffloadKey] | None = None) -> int:
        """End `owner`'s claims on `keys` (all of them when None): its load is over or
        the request ended. How many claims ended."""
        if owner is None:
            return 0
        claims = self._owners.get(owner)
        if claims is None:
            return 0
        ended = self._end(claims.values(), None if keys is None else set(keys))
        for tier in [t for t, c in claims.items() if not c.keys]:
            del claims[tier]
        if not claims:
            del self._owners[owner]
        return ended

    def let_go_all(self) -> None:
        """End every claim (the cache is closing)."""
        while self._owners:
            _, claims = self._owners.popitem(last=False)
            self._end(claims.values(), None)
        self._anonymous.clear()

    def sweep(self) -> None:
        """Count and forget the owners whose every claim ran out, oldest first, up to
        the first owner with a claim still live (owners are in the order they last
        claimed, so those behind it are mostly younger: swept on a later call)."""
        owners = self._owners
        now = self._clock()
        while owners:
            owner, claims = next(iter(owners.items()))
            if any(c.deadline > now for c in claims.values()):
                return
            del owners[owner]
            self._forget_anonymous(owner, claims.values())  # before _end empties them
            self._end(claims.values(), None)

    def _forget_anonymous(self, owner: str, claims: Iterable[Taken]) -> None:
        """An anonymous owner swept out: drop it from the per-key queues (bounded
        memory however many lookups never load)."""
        if not owner.startswith(ANONYMOUS):
            return
        anonymous = self._anonymous
        for claim in claims:
            for key in claim.keys:
                owners = anonymous.get(key)
                if owners is None:
                    continue
                with contextlib.suppress(ValueError):
                    owners.remove(owner)
                if not owners:
                    del anonymous[key]

    def _end(self, claims: Iterable[Taken], keys: set[OffloadKey] | None) -> int:
        """End the claims on `keys` (all when None) among `claims`, removing them from
        those records: let go while their lease lasts, else counted expired."""
        now = self._clock()
        ended = 0
        for claim in claims:
            mine = claim.keys if keys is None else claim.keys & keys
            if not mine:
                continue
            claim.keys = claim.keys - mine
            self._tiers[claim.tier].unprotect(list(mine), expired=now >= claim.deadline)
            ended += len(mine)
        return ended
