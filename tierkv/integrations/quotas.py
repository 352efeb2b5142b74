"""Per-tenant quotas under an engine: which of a chain's `tenants.quotas` an adapter
can keep, and the inline `tenants` key of the adapters whose users write tiers inline.

An engine adapter drives only the secondary tiers (`tierkv.driver`); the primary is
the engine's own (vLLM's CPU tier, SGLang's host pool, LMCache's L1), filled and
emptied by the engine. So the tiers' quotas apply (`GuardedTier.set_quotas`: each
store runs inside its tenant's share, on the tiers that name their victims), and a
quota on the primary is refused rather than silently not kept. The tenant of a
store is the one the adapter derives from its engine (`ReqContext.tenant`): a salt
by its digest (`salt-` and 8 hex digits, `tierkv.contract.tenants.salt_tenant`), so
that is the name a quota gives such a tenant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierkv.config import CacheConfig
from tierkv.contract.errors import ConfigError
from tierkv.quotas.config import PRIMARY_KEY, TierQuotas

__all__ = [
    "INLINE_TENANT_KEYS",
    "Engine",
    "as_written",
    "check_inline_tenants",
    "quotas_text",
    "tier_quotas",
]

INLINE_TENANT_KEYS = ("quotas",)
"""What an inline `tenants` key of an adapter's config may hold."""


@dataclass(frozen=True)
class Engine:
    """Who an adapter serves, for its messages."""

    name: str  # "SGLang"
    primary: str  # what its primary is: "its host pool"
    source: str  # where its config comes from (`ConfigError.source`)

    def problem(self, where: str, text: str) -> ConfigError:
        return ConfigError([f"{where}: {text}"], source=self.source)

    def primary_problem(self, where: str) -> ConfigError:
        return self.problem(
            f"{where}.{PRIMARY_KEY}",
            f"not available under {self.name}, whose primary is {self.primary}: "
            f"{self.name} decides what it holds, and tierkv holds only the tiers below "
            "it to quotas. Quota the tiers (by their names), and remove this one",
        )


def check_inline_tenants(value: Any, where: str, engine: Engine) -> dict[str, Any] | None:
    """An adapter's inline `tenants` (`{"quotas": {<tier>: {...}}}`) as given, for the
    chain `parse_config` validates (which says what is wrong inside `quotas`). A key
    besides `quotas`, and a quota on the primary, are refused here, at `where`."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise engine.problem(
            where,
            'expected an object such as {"quotas": {"<tier name>": {"tenants": '
            f'{{"<tenant>": "50%"}}}}}}}}, got {type(value).__name__}',
        )
    unknown = sorted(set(value) - set(INLINE_TENANT_KEYS))
    if unknown:
        raise engine.problem(
            f"{where}.{unknown[0]}",
            f"unknown field (under {engine.name} tierkv reads "
            f"{', '.join(INLINE_TENANT_KEYS)} here)",
        )
    quotas = value.get("quotas")
    if isinstance(quotas, Mapping) and PRIMARY_KEY in quotas:
        raise engine.primary_problem(f"{where}.quotas")
    return dict(value)


def tier_quotas(config: CacheConfig, where: str, engine: Engine) -> dict[str, TierQuotas]:
    """The chain's quotas by tier name (`parse_config` checked them); a quota on the
    primary (at `where.primary`) is refused."""
    quotas = config.tenants.quotas
    if PRIMARY_KEY in quotas:
        raise engine.primary_problem(where)
    return dict(quotas)


def as_written(problem: str, prefix: str) -> str:
    """A problem `parse_config` found in the chain an adapter made of its inline
    `tiers` and `tenants`, at the path the user wrote it (`prefix` before it, e.g.
    `extra_config.`); a tier name it suggests for `tenants.quotas` leaves out the
    primary, whose quotas no adapter keeps."""
    if not problem.startswith(("tiers", "tenants")):
        return problem
    return prefix + problem.replace(f"use one of {PRIMARY_KEY!r}, ", "use one of ")


def quotas_text(quotas: Mapping[str, Any]) -> str:
    """`acme 50%, default 10%, no borrowing`: one tier's quotas (`TierQuotas.model_dump()`,
    amounts as written), for the adapters' `check` reports."""
    parts = [f"{name} {amount}" for name, amount in quotas.get("tenants", {}).items()]
    if quotas.get("default") is not None:
        parts.append(f"default {quotas['default']}")
    if not quotas.get("borrow", True):
        parts.append("no borrowing")
    return ", ".join(parts) or "none"
