"""What `adapter_params` in LMCache's `--l2-adapter` JSON asks of tierkv.

    {"type": "plugin", "module_path": "tierkv.integrations.lmcache",
     "class_name": "TierkvL2Adapter",
     "adapter_params": {"tiers": [{"type": "nvme", "path": "/mnt/nvme/kv",
                                   "capacity": "500GiB"}]}}

or `"chain": "/etc/tierkv/chain.yaml"` in place of `tiers`. Optional: `namespace`
(default `lmcache`, or the chain file's), `lookup_timeout` (default 1s),
`object_bytes` (the sizes of LMCache's objects, whose tiers open with the adapter;
others open when an object of that size first comes), `record_keys` (the most keys
the adapter remembers for `list_l2_keys` and its usage, default 1,048,576), and
beside inline `tiers`, per-tenant quotas on them: `"tenants": {"quotas": {"nvme":
{"tenants": {"salt-0bc5fe16": "50%"}}}}` (a chain file has its own `tenants.quotas`;
`tierkv.integrations.quotas`). Each tier section goes through
`tierkv.config.parse_config`, so a mistake reads as `tierkv validate` says it, at the
path where it was written (`adapter_params.tiers[0].capacity: ...`). Nothing here
imports LMCache or torch: `tierkv lmcache check` runs where LMCache is not installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierkv.config import load_config, parse_config
from tierkv.contract.errors import ConfigError
from tierkv.contract.tier import TierConfig
from tierkv.contract.units import parse_duration, parse_size
from tierkv.integrations.quotas import Engine, as_written, check_inline_tenants, tier_quotas
from tierkv.quotas.config import TierQuotas

__all__ = ["SOURCE", "AdapterSettings", "resolve"]

SOURCE = "--l2-adapter adapter_params"
KEYS = (
    "tiers",
    "chain",
    "namespace",
    "lookup_timeout",
    "object_bytes",
    "record_keys",
    "tenants",
)
"""The keys tierkv reads from `adapter_params`."""
ENGINE = Engine("LMCache", "its L1 (LMCache's own memory)", SOURCE)
LOOKUP_TIMEOUT = 1.0
"""Seconds a lookup-and-lock waits for the tiers by default: LMCache's prefetch
controller asks ahead of the load, off the request's critical path."""
RECORD_KEYS = 1 << 20
"""Keys the adapter's key record holds by default (a few hundred bytes each: about
0.5 GB at the default; 1 TiB of 1 MiB objects)."""
VALIDATION_BLOCK = 1 << 20
"""The block size tier sections are validated with where `object_bytes` names no size
(a tier's settings do not depend on it; each object size gets its own tiers, built for
that size). With `object_bytes`, the smallest: a quota is checked to hold at least one
object of it."""


@dataclass(frozen=True)
class AdapterSettings:
    """Validated `adapter_params`: the tiers in chain order and how to call them."""

    tiers: tuple[TierConfig, ...]
    names: tuple[str, ...]
    namespace: str
    lookup_timeout: float
    object_bytes: tuple[int, ...]
    record_keys: int = RECORD_KEYS
    quotas: dict[str, TierQuotas] = field(default_factory=dict)
    """Per-tenant quotas by tier name, kept by each object size's chain
    (`SyncChain(quotas=...)`)."""

    def namespace_for(self, size: int) -> str:
        """The namespace of the tiers holding objects of `size` bytes (an nvme tier
        keeps one directory per namespace; keys carry model, rank, group and salt)."""
        return f"{self.namespace}|obj{size}"


def _problem(where: str, text: str) -> ConfigError:
    return ConfigError([f"{where}{text}"], source=SOURCE)


def resolve(
    params: Mapping[str, Any] | None, *, env: Mapping[str, str] | None = None
) -> AdapterSettings:
    """Validate `adapter_params`; `ConfigError` names every problem by its path."""
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise _problem("adapter_params", f": expected an object, got {type(params).__name__}")
    unknown = sorted(set(params) - set(KEYS))
    if unknown:
        raise _problem(
            f"adapter_params.{unknown[0]}", f": unknown field (tierkv reads {', '.join(KEYS)})"
        )
    inline, chain = params.get("tiers"), params.get("chain")
    if (inline is None) == (chain is None):
        raise _problem(
            "adapter_params",
            ': give exactly one of "tiers" (a list of tier sections, e.g. [{"type": '
            '"nvme", "path": ..., "capacity": ...}]) or "chain" (a tierkv YAML file)',
        )
    namespace = params.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not namespace.strip()):
        raise _problem("adapter_params.namespace", f": {namespace!r} must be a non-empty string")
    lookup = _duration(params.get("lookup_timeout"))
    sizes = _sizes(params.get("object_bytes"))
    record = params.get("record_keys", RECORD_KEYS)
    if isinstance(record, bool) or not isinstance(record, int) or record <= 0:
        raise _problem(
            "adapter_params.record_keys", f": {record!r} must be a positive whole number of keys"
        )
    tenants = check_inline_tenants(params.get("tenants"), "adapter_params.tenants", ENGINE)
    if inline is not None:
        if not isinstance(inline, list) or not inline:
            raise _problem("adapter_params.tiers", f": expected a non-empty list, got {inline!r}")
        try:
            block = min(sizes, default=VALIDATION_BLOCK)
            config = parse_config(_chain_of(inline, tenants, block), source=SOURCE, env=env)
        except ConfigError as exc:  # say the paths as the user wrote them
            problems = [as_written(p, "adapter_params.") for p in exc.problems]
            raise type(exc)(problems, source=exc.source) from None
        default = "lmcache"
    else:
        if tenants is not None:
            raise _problem(
                "adapter_params.tenants",
                f": only beside inline tiers; with a chain file, write its quotas in the "
                f"file ({chain}: tenants.quotas)",
            )
        config = load_config(str(chain), env=env)  # errors name the file and YAML path
        if not config.tiers:
            raise _problem("adapter_params.chain", f": {chain} lists no tiers")
        default = config.namespace
        if lookup is None and "lookup_timeout" in config.model_fields_set:
            lookup = config.lookup_timeout  # the file's own, not the embedded cache's 50 ms
    where = "adapter_params.tiers" if inline is not None else f"{chain}: tiers"
    for i, tier in enumerate(config.tiers):
        _check_policy(tier, f"{where}[{i}]")
    quotas_at = (
        "adapter_params.tenants.quotas" if inline is not None else f"{chain}: tenants.quotas"
    )
    return AdapterSettings(
        tiers=tuple(config.tiers),
        names=tuple(config.tier_names()),
        namespace=namespace or default,
        lookup_timeout=LOOKUP_TIMEOUT if lookup is None else lookup,
        object_bytes=sizes,
        record_keys=record,
        quotas=tier_quotas(config, quotas_at, ENGINE),
    )


def _duration(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except (ValueError, TypeError) as exc:
        raise _problem("adapter_params.lookup_timeout", f": {exc}") from None


def _sizes(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    sizes = []
    for i, item in enumerate(items):
        try:
            size, _ = parse_size(item)
        except (ValueError, TypeError) as exc:
            raise _problem(f"adapter_params.object_bytes[{i}]", f": {exc}") from None
        if size <= 0:
            raise _problem(f"adapter_params.object_bytes[{i}]", f": {item!r} must be positive")
        sizes.append(size)
    return tuple(dict.fromkeys(sizes))


def _chain_of(
    inline: list[Any], tenants: dict[str, Any] | None = None, block: int = VALIDATION_BLOCK
) -> dict[str, Any]:
    """A chain for `parse_config` (its layout and primary only satisfy the parser),
    with the inline `tenants`, whose quotas it checks against the tiers."""
    return {
        "namespace": "lmcache",
        "layout": {"block_bytes": block, "groups": [{"kind": "full", "block_size": 16}]},
        "primary": {"capacity": block},
        "tiers": inline,
        **({"tenants": tenants} if tenants is not None else {}),
    }


def _check_policy(tier: TierConfig, where: str) -> None:
    """LMCache's store controller decides what goes to L2 and writes it at once: every
    tier is written through; a policy that would hold objects back has nothing to act
    on."""
    if tier.write_policy != "write_through":
        raise _problem(
            f"{where}.write_policy",
            f": {tier.write_policy!r} is not available under LMCache, whose store "
            "controller writes every object it sends to L2 at once (write_through); "
            "remove the field",
        )
    if tier.admission != "all":
        raise _problem(
            f"{where}.admission",
            f": {tier.admission!r} is not available under LMCache, whose store policy "
            "decides which objects reach L2; remove the field",
        )
