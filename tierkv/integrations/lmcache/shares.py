"""`SectionShares`: each tenant's bytes in a shared section, over every object size,
against its quota; and whose blocks a store may evict there.

Why: under LMCache every object size has its own instance of a tier, and each
instance keeps its tenants' quotas in its own blocks (`tierkv.quotas`), but the
section's one `capacity` (`budget.SharedBudget`) is what fills. Evicting by age alone
across sizes let a tenant flooding one size take the blocks another tenant's
guarantee covers in another size. The shared budget asks this ledger instead, with
the rule of `tierkv.quotas.book` in bytes (a block's footprint, which differs by
size):

1. Free room first; a capped tenant takes free room past its cap only when the
   section `borrow`s.
2. Then, while the storing tenant stays within its cap, blocks of tenants not named
   in the quotas (and blocks of no known tenant: left by an earlier process) and
   named tenants' blocks past their quota (whole blocks that fit in the excess),
   least recently used first; then the storing tenant's own blocks. A named tenant's
   bytes up to its quota are never taken by another tenant.
3. What is left fails the store `no room`.

Named quotas are checked to fit the section together where the per-size instances
check them (`QuotaBook`), in blocks. Driven from the event loop only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import NamedTuple

from tierkv.contract.keys import OffloadKey
from tierkv.quotas.book import tenant_name
from tierkv.quotas.config import QuotaAmount, TierQuotas

__all__ = ["SectionShares"]

Accept = Callable[[OffloadKey, int], bool]
"""Whether a candidate block (key, footprint bytes) may be evicted; stateful: called
once for each block the walk would take, in order."""


class Limit(NamedTuple):
    """A quota in bytes: of footprint (a share of the section's `capacity`, which
    footprints fill) or of objects (`2GiB`: what the tenant's objects hold, as each
    size's instance counts it, in blocks of its object size)."""

    nbytes: int
    objects: bool


def _limit(amount: QuotaAmount, capacity: int) -> Limit:
    if amount.share is not None:
        return Limit(int(capacity * amount.share), False)
    return Limit(int(amount.nbytes or 0), True)


class Owner(NamedTuple):
    tenant: str
    footprint: int  # bytes of the section's capacity the block takes
    objects: int  # its object's bytes


class SectionShares:
    """Tenants' bytes in one shared section (see the module docstring). Room is
    counted in footprint bytes; a quota of object bytes is converted at the ratio of
    the blocks a store writes (`ratio`: footprint over object bytes)."""

    def __init__(self, quotas: TierQuotas, capacity: int) -> None:
        self.borrow = quotas.borrow
        self.limits = {name: _limit(a, capacity) for name, a in quotas.tenants.items()}
        self.default = None if quotas.default is None else _limit(quotas.default, capacity)
        self.owner: dict[OffloadKey, Owner] = {}
        self.held: Counter[str] = Counter()  # footprint bytes
        self.held_objects: Counter[str] = Counter()
        self.pending: Counter[str] = Counter()  # footprint bytes reserved by running stores
        self.pending_objects: Counter[str] = Counter()

    @staticmethod
    def name(tenant: str | None) -> str:
        return tenant_name(tenant)

    def limit(self, tenant: str) -> Limit | None:
        return self.limits.get(tenant, self.default)

    def headroom(self, tenant: str, ratio: float) -> int | None:
        """Footprint bytes `tenant` may add within its quota, for blocks of `ratio`
        footprint per object byte (None: no cap; negative: past it)."""
        limit = self.limit(tenant)
        if limit is None:
            return None
        if limit.objects:
            left = limit.nbytes - self.held_objects[tenant] - self.pending_objects[tenant]
            return int(left * ratio)
        return limit.nbytes - self.held[tenant] - self.pending[tenant]

    # -- ownership ----------------------------------------------------------------------
    def add(self, tenant: str, blocks: Iterable[tuple[OffloadKey, int, int]]) -> None:
        """Blocks (key, footprint, object bytes) a store of `tenant` placed (a key held
        already keeps its owner)."""
        owner = self.owner
        for key, footprint, objects in blocks:
            if key not in owner:
                owner[key] = Owner(tenant, footprint, objects)
                self.held[tenant] += footprint
                self.held_objects[tenant] += objects

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        owner = self.owner
        for key in keys:
            was = owner.pop(key, None)
            if was is not None:
                _take(self.held, was.tenant, was.footprint)
                _take(self.held_objects, was.tenant, was.objects)

    def reserve(self, tenant: str, footprint: int, objects: int) -> None:
        self.pending[tenant] += footprint
        self.pending_objects[tenant] += objects

    def release(self, tenant: str, footprint: int, objects: int) -> None:
        _take(self.pending, tenant, footprint)
        _take(self.pending_objects, tenant, objects)

    # -- a store's room -----------------------------------------------------------------
    def split(self, tenant: str, need: int, free: int, ratio: float) -> tuple[int, int]:
        """For a store of `tenant` needing `need` footprint bytes (blocks of `ratio`)
        with `free` bytes free in the section: (bytes it takes from free room, bytes of
        others' blocks it may evict besides; the rest of `need` can only come from its
        own blocks)."""
        room = self.headroom(tenant, ratio)
        usable = free if room is None or self.borrow else max(0, min(free, room))
        took = min(usable, need)
        short = need - took
        grow = short if room is None else min(short, max(0, room - took))
        return took, grow

    def others(self, tenant: str) -> Accept:
        """Blocks a store of `tenant` may take from others: not named (or of no known
        tenant), or a named tenant's excess past its quota (counted down as taken)."""
        owner, limits = self.owner, self.limits
        excess = {}
        for name, limit in limits.items():
            held = (self.held_objects if limit.objects else self.held)[name]
            if name != tenant and held > limit.nbytes:
                excess[name] = held - limit.nbytes

        def accept(key: OffloadKey, _footprint: int) -> bool:
            was = owner.get(key)
            if was is None:
                return True
            if was.tenant == tenant:
                return False
            limit = limits.get(was.tenant)
            if limit is not None:  # only whole blocks of its excess: never below its quota
                size = was.objects if limit.objects else was.footprint
                left = excess.get(was.tenant, 0)
                if left < size:
                    return False
                excess[was.tenant] = left - size
            return True

        return accept

    def own(self, tenant: str) -> Accept:
        owner = self.owner

        def accept(key: OffloadKey, _footprint: int) -> bool:
            was = owner.get(key)
            return was is not None and was.tenant == tenant

        return accept

    def report(self) -> dict[str, dict[str, int | None]]:
        """Tenant -> footprint and object bytes held over every size, and its quota."""
        names = set(self.held) | set(self.limits)
        return {
            name: {
                "held_bytes": self.held.get(name, 0),
                "held_object_bytes": self.held_objects.get(name, 0),
                "quota_bytes": None if (limit := self.limit(name)) is None else limit.nbytes,
            }
            for name in sorted(names)
        }


def _take(counts: Counter[str], name: str, by: int) -> None:
    counts[name] -= by
    if counts[name] <= 0:
        del counts[name]
