"""Per-tenant quotas: how much of a tier each tenant may hold, and whose blocks a
store may evict (see `book` for the rule, `config` for the YAML)."""

from tierkv.quotas.config import QuotaAmount, TierQuotas

__all__ = ["QuotaAmount", "TierQuotas"]
