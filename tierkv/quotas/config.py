"""The YAML of per-tenant quotas (`tenants.quotas`), one section per tier:

    tenants:
      quotas:
        primary:            # the primary; any other key is a secondary tier's name
          default: 20%      # each tenant not named below: a cap (absent: no cap)
          borrow: true      # a tenant past its quota may still take free room
          tenants:
            acme: 50%       # a named tenant: guaranteed this much, and capped at it
            beta: 2GiB

An amount is a share of the tier's capacity (`50%`) or a size (`2GiB`). A named
tenant's quota is both a guarantee (no other tenant's store evicts its blocks while
it holds no more than its quota) and a cap; the default is a cap for each tenant not
named, with no guarantee (their blocks are evicted in policy order, as without
quotas). `tierkv.quotas.book` has the eviction rule these settle.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer

from tierkv.contract.tenants import DEFAULT_TENANT, OTHER_TENANTS
from tierkv.contract.units import format_size, parse_size

PRIMARY_KEY = "primary"
"""The key of `tenants.quotas` that means the primary tier."""

_SHARE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


class QuotaAmount(BaseModel):
    """A quota as written: a share of the tier's capacity or a number of bytes."""

    model_config = ConfigDict(frozen=True)

    share: float | None = None  # 0 < share <= 1
    nbytes: int | None = None
    text: str = ""

    def blocks(self, capacity_blocks: int, block_bytes: int) -> int:
        """The quota in blocks of `block_bytes` of a tier holding `capacity_blocks`."""
        if self.share is not None:
            return int(capacity_blocks * self.share)
        assert self.nbytes is not None
        return self.nbytes // block_bytes

    def __str__(self) -> str:
        return self.text

    @model_serializer
    def _as_written(self) -> str:
        """Dumped as written (`50%`, `2GiB`), so a dumped config reads back."""
        return self.text


def parse_amount(value: object) -> QuotaAmount:
    """`50%` -> a share; `2GiB`, `4096` -> bytes. A message says what is accepted."""
    if isinstance(value, QuotaAmount):
        return value
    if isinstance(value, bool):
        raise ValueError(
            f"{value!r} is not a quota (write a share such as 25% or a size such as 2GiB)"
        )
    if isinstance(value, str) and (m := _SHARE.match(value)):
        share = float(m.group(1)) / 100
        if not 0 < share <= 1:
            raise ValueError(f"{value!r}: a share must be above 0% and at most 100%")
        return QuotaAmount(share=share, text=value.strip())
    try:
        nbytes, _ = parse_size(value, binary_only=False)
    except ValueError as e:
        raise ValueError(
            f"{value!r} is not a quota: write a share of the tier (25%) or a size (2GiB) ({e})"
        ) from None
    if nbytes <= 0:
        raise ValueError(f"{value!r}: a quota must be more than 0 bytes")
    return QuotaAmount(nbytes=nbytes, text=str(value).strip())


Amount = Annotated[QuotaAmount, BeforeValidator(parse_amount)]


class TierQuotas(BaseModel):
    """The quotas of one tier (`tenants.quotas.<tier>`)."""

    model_config = ConfigDict(extra="forbid")

    default: Amount | None = Field(
        default=None,
        description="the cap of each tenant not named in `tenants` (no guarantee); "
        "absent: tenants not named are not capped",
    )
    borrow: bool = Field(
        default=True,
        description="a tenant at its quota may still take free room (never another "
        "tenant's block); false: it evicts its own blocks or is declined",
    )
    tenants: dict[str, Amount] = Field(
        default_factory=dict,
        description="tenant name -> its quota: guaranteed (no other tenant evicts its "
        "blocks while it holds no more) and capped",
    )

    def model_post_init(self, context: Any) -> None:
        for name in self.tenants:
            if name == OTHER_TENANTS:
                raise ValueError(
                    f"tenant name {OTHER_TENANTS!r} is reserved (reports sum the tenants "
                    "past the largest few under it); quota the tenants by their own names"
                )
            if not name:
                raise ValueError(
                    f"a tenant name may not be empty; the default tenant is {DEFAULT_TENANT!r}"
                )


def quota_problems(
    quotas: dict[str, TierQuotas],
    tiers: dict[str, int | None],
    block_bytes: int,
) -> list[str]:
    """What is wrong with `tenants.quotas` against the chain: `tiers` maps `primary`
    and each tier's name to its capacity in bytes (None when its config has none).
    Keys that name no tier, a tier named `primary`, named quotas that add up to more
    than the tier (they are guarantees), and quotas smaller than one block."""
    problems: list[str] = []
    unknown = [k for k in quotas if k not in tiers]
    if unknown:
        names = ", ".join(map(repr, tiers))
        problems.append(
            f"tenants.quotas: {', '.join(map(repr, unknown))} names no tier of the chain; "
            f"use one of {names}"
        )
    for tier, section in quotas.items():
        if tier not in tiers:
            continue
        where = f"tenants.quotas.{tier}"
        capacity = tiers[tier]
        shares = sum(a.share for a in section.tenants.values() if a.share is not None)
        absolute = sum(a.nbytes for a in section.tenants.values() if a.nbytes is not None)
        if capacity is not None and shares * capacity + absolute > capacity * (1 + 1e-9):
            listed = ", ".join(f"{n}: {a}" for n, a in section.tenants.items())
            problems.append(
                f"{where}.tenants: the named quotas ({listed}) add up to more than the "
                f"tier holds ({format_size(capacity)}); a named quota is a guarantee, so "
                "they must fit together: lower them, or cap the smaller tenants through "
                "`default` (a cap, not a guarantee)"
            )
        elif shares > 1 + 1e-9:
            problems.append(
                f"{where}.tenants: the named shares add up to {shares:.0%}, more than the "
                "whole tier; a named quota is a guarantee, so they must fit together"
            )
        amounts = [(f"{where}.tenants.{n}", a) for n, a in section.tenants.items()]
        if section.default is not None:
            amounts.append((f"{where}.default", section.default))
        for path, amount in amounts:
            nbytes = amount.nbytes
            if nbytes is None and capacity is not None:
                nbytes = int((amount.share or 0) * capacity)
            if nbytes is not None and nbytes < block_bytes:
                problems.append(
                    f"{path}: {amount} is {format_size(nbytes)}, less than one block "
                    f"({format_size(block_bytes)}): the tenant could store nothing there; "
                    "raise it, or leave the tenant out"
                )
    return problems
