"""The model of a whole chain (`CacheConfig`) and how its tiers are named."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from tierkv.contract.redact import mask_secrets
from tierkv.contract.tier import TierConfig
from tierkv.contract.units import Duration
from tierkv.layout import KVLayout
from tierkv.primary import PrimaryConfig
from tierkv.quotas.config import TierQuotas


class TenantsConfig(BaseModel):
    """How the cache reports tenants (`ReqContext.tenant`)."""

    model_config = ConfigDict(extra="forbid")

    report_top: int = Field(
        default=10,
        ge=1,
        le=1000,
        description="tenants named in stats().tenants and the tierkv_tenant_* metrics: the "
        "ones that moved the most blocks (stored + loaded); the rest are summed as `other`, "
        "so a metric has at most report_top + 1 tenant labels",
    )
    isolate: bool = Field(
        default=False,
        description="keep each tenant's blocks apart even where their keys match: the "
        "same token blocks stored by two tenants are two blocks, and neither tenant's "
        "lookup finds the other's (a faster hit then reveals nothing of another "
        "tenant's prompts; costs the sharing of common prefixes across tenants)",
    )
    quotas: dict[str, TierQuotas] = Field(
        default_factory=dict,
        description="per-tier byte quotas per tenant: `primary` or a tier's name -> "
        "{default, borrow, tenants}; see docs/tenants.md",
    )


class CacheConfig(BaseModel):
    """A whole tier chain: namespace, KV layout, primary, secondary tiers in order."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(
        min_length=1,
        description="mixed into every stored name: model, tokenizer, dtype, parallel "
        "layout, tenant. Two namespaces never see each other's blocks.",
    )
    layout: KVLayout
    primary: PrimaryConfig
    tiers: list[SerializeAsAny[TierConfig]] = Field(default_factory=list)
    promotion_reserve: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="share of primary slots that promotions (loads from lower tiers) may "
        "hold at once; stores leave the part no promotion holds free for them",
    )
    promotion_wait: Duration = Field(
        default=0.05,
        ge=0,
        description="how long a load may wait in all for primary room to promote its "
        "blocks before the rest is shed as misses: added time to first token vs "
        "recomputing those blocks (0: shed whenever no room is free at that instant)",
    )
    prefetch_share: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="share of the promotion reserve that prefetches for queued requests "
        "may hold at once (blocks being read plus blocks held for their request); loads "
        "keep the rest (0: prefetch promotes nothing)",
    )
    lookup_timeout: Duration | None = Field(
        default=0.05,
        description="a tier that does not answer a lookup in time is a miss (null: no limit)",
    )
    store_timeout: Duration = Field(
        default=30.0,
        gt=0,
        description="how long a store larger than the primary's free room may wait for "
        "cascades to release slots before the rest of it is rejected",
    )
    write_back_max_dirty: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="share of primary slots that may hold blocks not yet written to a "
        "write_back tier; past it they are written back (or, while the tier is down, "
        "dropped and counted)",
    )
    write_back_headroom: float = Field(
        default=0.125,
        ge=0,
        lt=1,
        description="with write_back tiers, demote blocks when free + evictable primary "
        "slots fall below this share",
    )
    close_timeout: Duration = Field(
        default=10.0, description="how long close() lets background jobs finish"
    )
    tenants: TenantsConfig = Field(
        default_factory=TenantsConfig,
        description="per-tenant accounting: how many tenants reports name",
    )

    @model_serializer(mode="wrap")
    def _mask_secrets(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """`model_dump()` / `model_dump_json()` never hold a password: secret fields read
        `***`, URLs keep everything but their password."""
        return mask_secrets(handler(self))

    @property
    def primary_blocks(self) -> int:
        return int(self.primary.capacity) // int(self.layout.block_bytes)

    def tier_names(self) -> list[str]:
        """How the cache names each tier, in chain order: its `name:` when the YAML
        gives one, else its type, or `type-i` (i its position) when several unnamed
        tiers share a type."""
        return tier_names(self.tiers)


PRIMARY_NAME = "cpu"
"""The name the primary goes by in stats, metrics and load sources: no tier may take it."""


def tier_names(tiers: list[TierConfig]) -> list[str]:
    """See `CacheConfig.tier_names`."""
    unnamed = [t.type for t in tiers if t.name is None]
    return [
        t.name
        if t.name is not None
        else (t.type if unnamed.count(t.type) == 1 else f"{t.type}-{i}")
        for i, t in enumerate(tiers)
    ]
