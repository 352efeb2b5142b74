"""What a `{"type": "tierkv", ...}` entry of vLLM's `secondary_tiers` asks for.

    {"type": "tierkv", "tier": {"type": "nvme", "path": "/mnt/nvme/kv", "capacity": "500GiB"}}
    {"type": "tierkv", "chain": "/etc/tierkv/chain.yaml", "chain_tier": "redis"}

The tier section is validated by the tier plugin's own pydantic model, through
`tierkv.config.parse_config`, so a mistake reads exactly as `tierkv validate` says it,
with the path where the user wrote it (`secondary_tiers[0].tier.capacity: ...`).
Nothing here imports vLLM: the adapter hands in what vLLM knows as plain values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from tierkv.config import CacheConfig, load_config, parse_config
from tierkv.errors import ConfigError
from tierkv.tier import TierConfig
from tierkv.units import parse_duration

ENTRY_KEYS = (
    "tier",
    "chain",
    "chain_tier",
    "namespace",
    "medium",
    "locality",
    "shutdown_grace",
    "drain_timeout",
)
"""The keys a `tierkv` entry of `secondary_tiers` may carry (besides vLLM's own)."""

# vLLM's labels for where each first-party tier type keeps its blocks (a `kv_load_tiers`
# filter and the hit-source metrics read them); other types default to STORAGE with
# no locality. An entry's `medium` / `locality` overrides them.
PLACES: dict[str, tuple[str, str | None]] = {
    "memory": ("CPU", "LOCAL"),
    "nvme": ("STORAGE", "LOCAL"),
    "redis": ("CPU", "REMOTE"),
    "s3": ("STORAGE", "REMOTE"),
}
_MEDIA = ("CPU", "STORAGE")
_LOCALITIES = ("LOCAL", "REMOTE")


@dataclass(frozen=True)
class VllmGeometry:
    """The facts vLLM knows that decide whether two processes may share blocks."""

    model: str
    dtype: str
    tokens_per_block: tuple[int, ...]
    blocks_per_chunk: int
    tokens_per_hash: int
    row_bytes: int
    parallel: Mapping[str, Any]
    layout: Mapping[str, Any]

    def default_namespace(self) -> str:
        """`vllm:<model>:<dtype>:<tokens per chunk>t:<parallel layout>:<digest>`.

        Readable for the common fields; the digest covers everything (the exact row
        size, group block sizes, canonical/replicated layout), so two engines whose
        blocks differ in any byte-relevant way never read each other's blocks. A
        portable layout (parallelism-agnostic or replicated) reads `any` and leaves the
        topology (TP/PP/CP sizes, bytes per worker) out of the digest."""
        tokens = "-".join(str(t * self.blocks_per_chunk) for t in self.tokens_per_block)
        p = self.parallel
        layout_facts = dict(self.layout)
        parallel = dict(p)
        if p.get("is_parallelism_agnostic") or self.layout.get("replicated_layout"):
            # a block's bytes are the same under any TP/PP/CP (vLLM's fs and obj tiers
            # collapse them too): engines of one model share whatever their topology
            layout = "any"
            parallel = {"portable": True}
            layout_facts.pop("worker_kv_bytes_per_block", None)  # differs with TP
        else:
            layout = f"tp{p.get('tp_size', 1)}pp{p.get('pp_size', 1)}"
            if p.get("pcp_size", 1) != 1 or p.get("dcp_size", 1) != 1:
                layout += f"pcp{p.get('pcp_size', 1)}dcp{p.get('dcp_size', 1)}"
        everything = json.dumps(
            {
                "model": self.model,
                "dtype": self.dtype,
                "tokens_per_block": self.tokens_per_block,
                "blocks_per_chunk": self.blocks_per_chunk,
                "tokens_per_hash": self.tokens_per_hash,
                "row_bytes": self.row_bytes,
                "parallel": parallel,
                "layout": layout_facts,
            },
            sort_keys=True,
            default=str,
        )
        digest = hashlib.sha256(everything.encode()).hexdigest()[:12]
        return f"vllm:{self.model}:{self.dtype}:{tokens}t:{layout}:{digest}"


@dataclass(frozen=True)
class TierkvEntry:
    """A validated `tierkv` entry: the tier's config and the namespace to use."""

    tier: TierConfig
    namespace: str
    name: str
    medium: str = "STORAGE"  # vLLM's Medium name
    locality: str | None = None  # vLLM's Locality name
    shutdown_grace: float = 10.0  # seconds jobs in flight get at shutdown
    drain_timeout: float | None = None  # seconds drain_jobs waits; None: job_timeout + grace


def _place(entry: Mapping[str, Any], tier_type: str, where: str) -> tuple[str, str | None]:
    """The entry's (medium, locality): its own, else the tier type's (`PLACES`)."""
    medium, locality = PLACES.get(tier_type, ("STORAGE", None))
    for key, allowed in (("medium", _MEDIA), ("locality", _LOCALITIES)):
        value = entry.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or value.upper() not in allowed:
            raise _problem(f"{where}.{key}", f": {value!r} is not one of {', '.join(allowed)}")
        if key == "medium":
            medium = value.upper()
        else:
            locality = value.upper()
    return medium, locality


def _problem(where: str, text: str) -> ConfigError:
    return ConfigError([f"{where}{text}"], source="--kv-transfer-config")


def resolve_entry(
    entry: Mapping[str, Any],
    geometry: VllmGeometry,
    *,
    where: str = "secondary_tiers[?]",
    env: Mapping[str, str] | None = None,
) -> TierkvEntry:
    """Validate one `tierkv` entry (`tier` inline or `chain` + `chain_tier`).

    Raises `ConfigError` (or its subclasses `UnknownTierType`, `PluginImportError`)
    with every problem prefixed by its path inside `--kv-transfer-config`."""
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise _problem(
            f"{where}.{unknown[0]}",
            f": unknown field (a tierkv entry takes: {', '.join(ENTRY_KEYS)})",
        )
    inline, chain = entry.get("tier"), entry.get("chain")
    if (inline is None) == (chain is None):
        raise _problem(
            where,
            ': give exactly one of `tier` (a tier section, e.g. {"type": "nvme", '
            '"path": ..., "capacity": ...}) or `chain` (a tierkv YAML file)',
        )
    namespace = entry.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not namespace.strip()):
        raise _problem(f"{where}.namespace", f": {namespace!r} must be a non-empty string")
    if inline is not None:
        if "chain_tier" in entry:
            raise _problem(f"{where}.chain_tier", ": only with `chain`")
        if not isinstance(inline, Mapping):
            raise _problem(f"{where}.tier", f": expected a tier section (mapping), got {inline!r}")
        config = _validate_inline(inline, geometry, namespace, f"{where}.tier", env)
        tier = config.tiers[0]
        resolved = TierkvEntry(
            tier, namespace or geometry.default_namespace(), config.tier_names()[0]
        )
    else:
        resolved = _from_chain(str(chain), entry.get("chain_tier"), geometry, namespace, where, env)
    medium, locality = _place(entry, resolved.tier.type, where)
    grace = _seconds(entry, "shutdown_grace", where)
    drain = _seconds(entry, "drain_timeout", where)
    return replace(
        resolved,
        medium=medium,
        locality=locality,
        shutdown_grace=10.0 if grace is None else grace,
        drain_timeout=drain,
    )


def _seconds(entry: Mapping[str, Any], key: str, where: str) -> float | None:
    """A duration field of the entry (`2.5`, `"500ms"`, `"30s"`), or None if absent."""
    value = entry.get(key)
    if value is None:
        return None
    try:
        return parse_duration(value)
    except (ValueError, TypeError) as exc:
        raise _problem(f"{where}.{key}", f": {exc}") from None


def _validate_inline(
    inline: Mapping[str, Any],
    geometry: VllmGeometry,
    namespace: str | None,
    where: str,
    env: Mapping[str, str] | None,
) -> CacheConfig:
    """Run the tier section through the same parser `tierkv validate` uses, in a chain
    whose layout and primary are vLLM's, then say the paths as the user wrote them."""
    chain = {
        "namespace": namespace or "vllm",
        "layout": {
            "block_bytes": geometry.row_bytes,
            "groups": [{"block_size": t} for t in geometry.tokens_per_block],
        },
        "primary": {"capacity": geometry.row_bytes},
        "tiers": [dict(inline)],
    }
    try:
        config = parse_config(chain, source="--kv-transfer-config", env=env)
    except ConfigError as exc:
        problems = [
            where + p[len("tiers[0]") :] if p.startswith("tiers[0]") else p for p in exc.problems
        ]
        raise type(exc)(problems, source=exc.source) from None
    _check_write_policy(config.tiers[0], where)
    return config


def _from_chain(
    path: str,
    chain_tier: Any,
    geometry: VllmGeometry,
    namespace: str | None,
    where: str,
    env: Mapping[str, str] | None,
) -> TierkvEntry:
    config = load_config(path, env=env)  # errors name the file and the YAML path
    names = config.tier_names()
    if not names:
        raise _problem(f"{where}.chain", f": {path} lists no tiers")
    if chain_tier is None:
        if len(names) != 1:
            raise _problem(
                f"{where}.chain_tier",
                f": {path} has {len(names)} tiers ({', '.join(names)}); name the one this "
                "entry is (one secondary_tiers entry per tier, in chain order)",
            )
        index = 0
    elif isinstance(chain_tier, int) and not isinstance(chain_tier, bool):
        if not 0 <= chain_tier < len(names):
            raise _problem(
                f"{where}.chain_tier", f": {chain_tier} is out of range 0..{len(names) - 1}"
            )
        index = chain_tier
    elif isinstance(chain_tier, str) and chain_tier in names:
        index = names.index(chain_tier)
    else:
        raise _problem(
            f"{where}.chain_tier",
            f": {chain_tier!r} is not a tier of {path} (its tiers: {', '.join(names)})",
        )
    tier = config.tiers[index]
    _check_write_policy(tier, f"{path}: tiers[{index}]")
    # the file's namespace (a tenant, say) plus vLLM's model and layout: two models
    # pointed at one chain file must never read each other's blocks
    default = f"{config.namespace}|{geometry.default_namespace()}"
    return TierkvEntry(tier, namespace or default, names[index])


def _check_write_policy(tier: TierConfig, where: str) -> None:
    if tier.write_policy != "write_through":
        raise _problem(
            f"{where}.write_policy",
            f": {tier.write_policy!r} is not available inside vLLM, which writes every "
            "block it offloads to every secondary tier (write_through); remove the field",
        )
    if tier.admission != "all":
        raise _problem(
            f"{where}.admission",
            f": {tier.admission!r} is not available inside vLLM, which writes every "
            "block it offloads to every secondary tier; remove the field",
        )
