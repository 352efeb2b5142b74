"""Who holds how many blocks of one tier, against their quotas, and whose blocks a
store may evict.

The rule, for a store (or promotion) of tenant `t` that needs room:

1. Free slots first. A capped tenant takes free slots past its cap only when its
   tier `borrow`s (the room is unused: nobody loses a block).
2. Victims, each pass in the tier's own eviction order: first, while `t` stays
   within its cap, blocks of tenants not named in the quotas (no guarantee: evicted
   as without quotas) and the excess of named tenants past their quota (what they
   borrowed); then `t`'s own blocks (its count stays the same: a tenant at its
   quota evicts its own least useful blocks). Others' takeable blocks go first, so
   a tenant within its quota keeps its own working set while someone else holds
   room it has no claim to. A named tenant's blocks up to its quota are never taken
   by another tenant.
3. What is left is declined for the tier, and counted (`declined`).

Named quotas are refused when they add up to more than the tier (`QuotaError`), so
every named tenant's guarantee can be kept at once: a tenant within its quota always
finds a free slot, an unguaranteed block or someone's excess, unless the blocks are
held (being read or written), as without quotas.

Keys are owned by the tenant whose store (or load, for a promotion) placed them,
until they leave the tier. One dict entry per block: the book exists only for tiers
that have quotas, so a cache without quotas pays nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from tierkv.contract.errors import ConfigError
from tierkv.contract.keys import OffloadKey
from tierkv.contract.tenants import DEFAULT_TENANT
from tierkv.contract.units import format_size
from tierkv.quotas.config import TierQuotas

logger = logging.getLogger(__name__)

CanEvict = Callable[[OffloadKey], bool]


def tenant_name(tenant: str | None) -> str:
    """The name a quota goes by: `default` for requests with no tenant."""
    return tenant or DEFAULT_TENANT


class QuotaBook:
    """The quotas of one tier in blocks, and who holds what there (see the module
    docstring). Not thread-safe: driven from the event loop thread."""

    def __init__(
        self,
        quotas: TierQuotas,
        capacity_blocks: int,
        block_bytes: int,
        *,
        tier: str,
        strict: bool = True,
    ) -> None:
        self.tier = tier
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.borrow = quotas.borrow
        self.limits: dict[str, int] = {
            name: amount.blocks(capacity_blocks, block_bytes)
            for name, amount in quotas.tenants.items()
        }
        self.default_cap: int | None = (
            None if quotas.default is None else quotas.default.blocks(capacity_blocks, block_bytes)
        )
        tier_bytes = capacity_blocks * block_bytes
        named = sum(
            a.share * tier_bytes if a.share is not None else a.nbytes or 0
            for a in quotas.tenants.values()
        )
        if named > tier_bytes * (1 + 1e-9):
            listed = ", ".join(f"{n}: {a}" for n, a in quotas.tenants.items())
            problem = (
                f"tenants.quotas.{tier}: the named quotas ({listed}) add up to more than "
                f"the tier holds ({format_size(tier_bytes)} of blocks); a named quota is a "
                "guarantee, so they must fit together: lower them, or quota the smaller "
                "tenants through `default` (a cap, not a guarantee)"
            )
            if strict:
                raise ConfigError(problem)
            # a tier's framed capacity is known only once open: say so, keep going (the
            # guarantees may then not all hold at once)
            logger.warning("%s", problem)
        self.owner: dict[OffloadKey, str] = {}
        self.held: dict[str, int] = {}
        self._unnamed_held = 0  # blocks of tenants not named (no guarantee)
        # blocks planned for a tenant whose store has not answered yet (a tier's
        # stores run concurrently: each plans with the others' blocks counted)
        self.pending: dict[str, int] = {}
        self.leaving: dict[str, int] = {}  # blocks chosen as victims, not yet removed
        self.declined: dict[str, int] = {}  # blocks declined for a quota, per tenant
        self.declined_total = 0

    # -- the quota of a tenant ------------------------------------------------------------
    def cap(self, tenant: str) -> int | None:
        """`tenant`'s cap in blocks (None: none)."""
        return self.limits.get(tenant, self.default_cap)

    def headroom(self, tenant: str) -> int | None:
        """Blocks `tenant` may add before its cap (negative past it; None: no cap),
        counting the blocks on their way (`pending`) as held and the victims being
        removed (`leaving`) as gone."""
        cap = self.cap(tenant)
        if cap is None:
            return None
        held = self.held.get(tenant, 0) + self.pending.get(tenant, 0)
        return cap - held + self.leaving.get(tenant, 0)

    def over(self, tenant: str) -> bool:
        """Whether `tenant` holds its cap or more (a store then needs its own victims)."""
        room = self.headroom(tenant)
        return room is not None and room <= 0

    # -- ownership ------------------------------------------------------------------------
    def add(self, tenant: str, keys: Sequence[OffloadKey]) -> None:
        """`keys` were placed for `tenant` (none of them was held before)."""
        if keys:
            self.owner.update(dict.fromkeys(keys, tenant))
            self.held[tenant] = self.held.get(tenant, 0) + len(keys)
            if tenant not in self.limits:
                self._unnamed_held += len(keys)

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        """`keys` left the tier (unknown keys are ignored)."""
        pop, held, limits = self.owner.pop, self.held, self.limits
        for key in keys:
            owner = pop(key, None)
            if owner is not None:
                if owner not in limits:
                    self._unnamed_held -= 1
                left = held[owner] - 1
                if left:
                    held[owner] = left
                else:
                    del held[owner]

    def note_declined(self, tenant: str, n: int) -> None:
        if n > 0:
            self.declined[tenant] = self.declined.get(tenant, 0) + n
            self.declined_total += n

    # -- what a store may take --------------------------------------------------------------
    def usable_free(self, tenant: str, free: int) -> int:
        """Free slots a store of `tenant` may take (all when it borrows or has room)."""
        room = self.headroom(tenant)
        if room is None or self.borrow:
            return free
        return max(0, min(free, room))

    def choose_victims(
        self,
        tenant: str,
        took_free: int,
        need: int,
        candidates: Callable[[int, CanEvict], list[OffloadKey]],
        base: CanEvict,
    ) -> list[OffloadKey]:
        """Up to `need` victims for a store of `tenant` that took `took_free` free
        slots, by the rule of the module docstring: first, while `tenant` stays within
        its cap, blocks of tenants not named and named tenants' excess; then its own
        blocks. Each in the tier's eviction order: `candidates(limit, predicate)` walks
        it (a policy's `candidates`); `base` is the caller's veto. Changes nothing."""
        if need <= 0:
            return []
        room = self.headroom(tenant)
        grow = need if room is None else min(need, max(0, room - took_free))
        chosen: list[OffloadKey] = []
        if grow > 0 and self._takeable_from_others(tenant) > 0:
            chosen = candidates(grow, self._others_filter(tenant, base))
        if len(chosen) < need:
            owner = self.owner

            def own(key: OffloadKey) -> bool:
                return owner.get(key, DEFAULT_TENANT) == tenant and base(key)

            chosen += candidates(need - len(chosen), own)
        return chosen

    def _takeable_from_others(self, tenant: str) -> int:
        """Blocks of other tenants the rule lets a store take (some may be held)."""
        held, limits = self.held, self.limits
        mine = held.get(tenant, 0) if tenant not in limits else 0
        excess = sum(
            max(0, held.get(name, 0) - cap) for name, cap in limits.items() if name != tenant
        )
        return self._unnamed_held - mine + excess

    def _others_filter(self, tenant: str, base: CanEvict) -> CanEvict:
        """Blocks of tenants not named, and named tenants' excess (stateful: each key
        it accepts counts against its owner's excess, so the walk must take exactly
        the keys it accepted)."""
        owner, limits, held = self.owner, self.limits, self.held
        excess = {
            name: held.get(name, 0) - cap
            for name, cap in limits.items()
            if name != tenant and held.get(name, 0) > cap
        }

        def may_take(key: OffloadKey) -> bool:
            who = owner.get(key, DEFAULT_TENANT)
            if who == tenant or not base(key):
                return False
            if who in limits:  # guaranteed up to its quota: only its excess
                left = excess.get(who, 0)
                if left <= 0:
                    return False
                excess[who] = left - 1
            return True

        return may_take

    # -- reports ------------------------------------------------------------------------------
    def report(self) -> dict[str, dict[str, int | None]]:
        """Tenant -> blocks held, cap and blocks declined (tenants holding or declined)."""
        names = set(self.held) | set(self.declined) | set(self.limits)
        return {
            name: {
                "held_blocks": self.held.get(name, 0),
                "quota_blocks": self.cap(name),
                "declined_blocks": self.declined.get(name, 0),
            }
            for name in sorted(names)
        }
