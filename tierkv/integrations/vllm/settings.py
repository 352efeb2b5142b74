"""What a `{"type": "tierkv", ...}` entry of vLLM's `secondary_tiers` asks for.

    {"type": "tierkv", "tier": {"type": "nvme", "path": "/mnt/nvme/kv", "capacity": "500GiB"},
     "quotas": {"default": "20%", "tenants": {"salt-0bc5fe16": "50%"}}}
    {"type": "tierkv", "chain": "/etc/tierkv/chain.yaml", "chain_tier": "redis"}

The tier section is validated by the tier plugin's own pydantic model, through
`tierkv.config.parse_config`, so a mistake reads exactly as `tierkv validate` says it,
with the path where the user wrote it (`secondary_tiers[0].tier.capacity: ...`). So
are the tier's per-tenant `quotas` (`TierQuotas`: `{default, borrow, tenants}`, as
one tier's section of a chain's `tenants.quotas`, checked against the tier's
capacity); an entry from a `chain` file takes the file's `tenants.quotas.<its tier>`
instead (`tierkv.integrations.quotas`).
Nothing here imports vLLM: the adapter hands in what vLLM knows as plain values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from tierkv.config import CacheConfig, load_config, parse_config
from tierkv.contract.errors import ConfigError
from tierkv.contract.tier import TierConfig
from tierkv.contract.units import parse_duration
from tierkv.integrations.quotas import Engine, tier_quotas
from tierkv.quotas.config import TierQuotas

ENTRY_KEYS = (
    "tier",
    "chain",
    "chain_tier",
    "namespace",
    "medium",
    "locality",
    "shutdown_grace",
    "drain_timeout",
    "tenant_from",
    "quotas",
)
"""The keys a `tierkv` entry of `secondary_tiers` may carry (besides vLLM's own)."""
SOURCE = "--kv-transfer-config"
ENGINE = Engine("vLLM", "vLLM's own CPU tier", SOURCE)

TENANT_SOURCES = ("cache_salt", "lora", "none")
"""What a request's tenant (`ReqContext.tenant`) is read from: its `cache_salt` (named
by a digest), its LoRA adapter's name, or nothing (every request the default tenant)."""

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
    group_names: tuple[str, ...] = ()  # for messages: "group <id> (<first layer>...)"

    def layout_groups(self, where: str = "secondary_tiers[?]") -> list[dict[str, Any]]:
        """vLLM's KV groups as tierkv layout groups (one per chunk), or ConfigError for
        a group tierkv cannot serve.

        vLLM's offloading API (0.33) describes a group by its tokens per block and
        `sliding_window_size_in_chunks`: None for full attention, else the chunks a
        hit needs ending at the hit point (sliding-window and chunked-local attention
        by their window, Mamba's recurrent state as one chunk). vLLM applies that rule
        itself, above the tier; the tier stores and loads whole chunks by key, so any
        such group is served. A window tierkv's layout states as `window` tokens
        needing exactly those chunks is `chunks * tokens_per_chunk + 1` (the next
        token sees the `window - 1` before it). A window that is not a whole number
        of chunks (vLLM never sends one) means a group kind this adapter does not
        know: refused rather than guessed at."""
        windows = list(self.layout.get("sliding_windows") or [None] * len(self.tokens_per_block))
        if len(windows) != len(self.tokens_per_block):
            raise _problem(
                where,
                f": vLLM described {len(self.tokens_per_block)} KV groups but "
                f"{len(windows)} sliding windows; this vLLM is not one tierkv knows (0.33)",
            )
        groups: list[dict[str, Any]] = []
        for i, (tokens, window) in enumerate(zip(self.tokens_per_block, windows)):
            name = self.group_names[i] if i < len(self.group_names) else f"group {i}"
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
                raise _problem(
                    where, f": vLLM's KV {name} has tokens_per_block={tokens!r}; expected >= 1"
                )
            chunk = tokens * self.blocks_per_chunk
            if window is None:
                groups.append({"kind": "full", "block_size": chunk})
            elif isinstance(window, int) and not isinstance(window, bool) and window >= 1:
                groups.append(
                    {"kind": "sliding_window", "block_size": chunk, "window": window * chunk + 1}
                )
            else:
                raise _problem(
                    where,
                    f": vLLM's KV {name} has sliding_window_size_in_chunks={window!r}, a group "
                    "kind tierkv cannot serve (it serves full attention, None, and groups "
                    "needing a whole number >= 1 of chunks before the hit: sliding window, "
                    "chunked local attention, Mamba). Leave this model's offloading to vLLM's "
                    "own tiers (drop the tierkv entries), or upgrade tierkv for this vLLM",
                )
        return groups

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
    tenant_from: str = "cache_salt"  # one of TENANT_SOURCES
    quotas: TierQuotas | None = None  # the tier's per-tenant quotas

    @property
    def drain_seconds(self) -> float:
        """How long `drain_jobs` waits before it cancels what runs."""
        if self.drain_timeout is not None:
            return self.drain_timeout
        return float(self.tier.job_timeout) + self.shutdown_grace


def index_of(offloading_spec: Any, entry: Mapping[str, Any]) -> int | None:
    """The position in `secondary_tiers` of the entry vLLM built us from."""
    configs = getattr(offloading_spec, "secondary_tier_configs", None) or []
    for i, config in enumerate(configs):
        if isinstance(config, Mapping) and all(
            config.get(k) is v or config.get(k) == v for k, v in entry.items()
        ):
            return i
    return None


def geometry_of(offloading_spec: Any, row_bytes: int) -> VllmGeometry:
    """What vLLM's normalized `OffloadingConfig` says about the bytes of a chunk."""
    config = offloading_spec.config
    parallel = {
        k: v
        for k, v in asdict(config.parallel).items()
        # per-process facts: DP replicas and ranks of one layout share blocks
        if k not in ("rank", "data_parallel_index", "data_parallel_rank_local")
    }
    layout = {
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
        "sliding_windows": [g.sliding_window_size_in_chunks for g in config.groups],
    }
    return VllmGeometry(
        model=str(config.model.name),
        dtype=str(config.model.dtype),
        tokens_per_block=tuple(int(g.tokens_per_block) for g in config.groups),
        blocks_per_chunk=int(config.cache.blocks_per_chunk),
        tokens_per_hash=int(config.cache.tokens_per_hash),
        row_bytes=row_bytes,
        parallel=parallel,
        layout=layout,
        group_names=tuple(
            f"group {g.group_id} ({', '.join(g.layer_names[:2])}"
            f"{', ...' if len(g.layer_names) > 2 else ''})"
            for g in config.groups
        ),
    )


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
    return ConfigError([f"{where}{text}"], source=SOURCE)


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
    geometry.layout_groups(where)  # a group kind the tier cannot serve: refused first
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
        quotas = entry.get("quotas")
        config = _validate_inline(inline, geometry, namespace, where, env, quotas)
        name = config.tier_names()[0]
        resolved = TierkvEntry(
            config.tiers[0],
            namespace or geometry.default_namespace(),
            name,
            quotas=config.tenants.quotas.get(name),
        )
    else:
        if "quotas" in entry:
            raise _problem(
                f"{where}.quotas",
                f": only with `tier`; an entry from a chain file takes the file's own "
                f"tenants.quotas (write them in {chain})",
            )
        resolved = _from_chain(str(chain), entry.get("chain_tier"), geometry, namespace, where, env)
    medium, locality = _place(entry, resolved.tier.type, where)
    grace = _seconds(entry, "shutdown_grace", where)
    drain = _seconds(entry, "drain_timeout", where)
    tenant_from = entry.get("tenant_from", "cache_salt")
    if tenant_from not in TENANT_SOURCES:
        raise _problem(
            f"{where}.tenant_from", f": {tenant_from!r} is not one of {', '.join(TENANT_SOURCES)}"
        )
    return replace(
        resolved,
        medium=medium,
        locality=locality,
        shutdown_grace=10.0 if grace is None else grace,
        drain_timeout=drain,
        tenant_from=tenant_from,
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
    quotas: Any = None,
) -> CacheConfig:
    """Run the tier section (and its `quotas`, as the chain's `tenants.quotas` of that
    tier) through the same parser `tierkv validate` uses, in a chain whose layout and
    primary are vLLM's, then say the paths as the user wrote them (`where.tier...`,
    `where.quotas...`)."""
    chain: dict[str, Any] = {
        "namespace": namespace or "vllm",
        "layout": {"block_bytes": geometry.row_bytes, "groups": geometry.layout_groups(where)},
        "primary": {"capacity": geometry.row_bytes},
        "tiers": [dict(inline)],
    }
    at = ""  # where the chain holds the quotas: `tenants.quotas.<the tier's name>`
    if quotas is not None:
        name = str(inline.get("name") or inline.get("type"))  # as `tier_names` names it
        at = f"tenants.quotas.{name}"
        chain["tenants"] = {"quotas": {name: quotas}}
    try:
        config = parse_config(chain, source=SOURCE, env=env)
    except ConfigError as exc:
        raise type(exc)(
            [_as_written(p, where, at) for p in exc.problems], source=exc.source
        ) from None
    _check_write_policy(config.tiers[0], f"{where}.tier")
    return config


def _as_written(problem: str, where: str, quotas_at: str) -> str:
    """A problem of the chain `_validate_inline` made, at the entry's own path."""
    if problem.startswith("tiers[0]"):
        return f"{where}.tier{problem[len('tiers[0]') :]}"
    after = problem[len(quotas_at) : len(quotas_at) + 1]
    if quotas_at and problem.startswith(quotas_at) and after in (".", ":"):
        return f"{where}.quotas{problem[len(quotas_at) :]}"
    return problem


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
    quotas = tier_quotas(config, f"{path}: tenants.quotas", ENGINE)
    # the file's namespace (a tenant, say) plus vLLM's model and layout: two models
    # pointed at one chain file must never read each other's blocks
    default = f"{config.namespace}|{geometry.default_namespace()}"
    return TierkvEntry(tier, namespace or default, names[index], quotas=quotas.get(names[index]))


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
