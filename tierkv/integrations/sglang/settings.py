"""What `--hicache-storage-backend-extra-config` asks of tierkv, and the facts of a host
pool that decide which processes may share its pages.

    {"backend_name": "tierkv", "module_path": "tierkv.integrations.sglang",
     "class_name": "TierkvHiCacheStorage", "interface_v1": 1,
     "tiers": [{"type": "nvme", "path": "/mnt/nvme/kv", "capacity": "500GiB"}]}

or `"chain": "/etc/tierkv/chain.yaml"` in place of `tiers`. Per-tenant quotas on the
tiers: beside inline `tiers`, `"tenants": {"quotas": {"nvme": {"tenants": {"acme":
"50%"}}}}`; in a chain file, its own `tenants.quotas` (`tierkv.integrations.quotas`).
Each tier section goes through `tierkv.config.parse_config`, so a mistake reads as
`tierkv validate` says it, at the path where the user wrote it
(`extra_config.tiers[0].capacity: ...`). Nothing here imports SGLang or torch:
`tierkv sglang check` runs where SGLang is not installed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierkv.config import CacheConfig, load_config, parse_config
from tierkv.contract.errors import ConfigError
from tierkv.contract.tier import TierConfig
from tierkv.contract.units import parse_duration
from tierkv.integrations.quotas import Engine, as_written, check_inline_tenants, tier_quotas
from tierkv.quotas.config import TierQuotas

SOURCE = "--hicache-storage-backend-extra-config"
OUR_KEYS = ("tiers", "chain", "namespace", "lookup_timeout", "tenants")
"""The keys tierkv reads from the extra config."""
SGLANG_KEYS = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "allocator",
    "file_storage_path",
    "tp_lcm_size",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
)
"""Keys SGLang 0.5.23 itself reads from the extra config: its dynamic loader's, the
host allocator's, `--file-storage-path` (which it adds for every backend); and the
prefetch settings and `tp_lcm_size`, which it takes out before the backend sees the
config (`tierkv sglang check` reads the JSON as written, so it meets them)."""
ENGINE = Engine("SGLang", "its host pool", SOURCE)
LOOKUP_TIMEOUT = 0.5
"""Seconds `batch_exists` waits for the tiers by default: SGLang asks from its prefetch
thread, off the request's critical path, and a remote tier asked for 128 pages of
2 x layers parts each needs more than the embedded cache's 50 ms."""


@dataclass(frozen=True)
class PoolGeometry:
    """The facts of one rank's host pool that decide the bytes of a page."""

    model: str
    dtype: str
    layout: str  # SGLang's host layout: page_first, layer_first, page_first_direct, ...
    page_size: int  # tokens per page
    part_bytes: int  # bytes of one region `get_page_buffer_meta` reports
    parts_per_page: int  # regions per page (2 page_first MHA, 2 x layers layer_first, 1 MLA)
    is_mla: bool
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    region_bytes: tuple[int, ...] = ()
    """Each region's bytes where a page's regions differ in size (a split MLA pool: K
    and V; `part_bytes` is then the first's); empty where they are all `part_bytes`."""

    @property
    def page_bytes(self) -> int:
        if self.region_bytes:
            return sum(self.region_bytes)
        return self.part_bytes * self.parts_per_page

    @property
    def shard(self) -> str:
        """Whose pages these are: `mla` (every TP rank holds the same pages) or
        `tp<rank>of<size>` (each rank its own head shard); `pp<rank>of<size>` after
        it with pipeline stages (each stage its own layers)."""
        shard = "mla" if self.is_mla else f"tp{self.tp_rank}of{self.tp_size}"
        return shard + (f"pp{self.pp_rank}of{self.pp_size}" if self.pp_size > 1 else "")

    def default_namespace(self) -> str:
        """`sglang:<model>:<dtype>:<page>t:<layout>:<shard>:<digest>`: readable for the
        common fields; the digest covers every byte-relevant fact, so two servers whose
        pages differ in any byte never read each other's pages, and two of one model
        share. An MHA rank's shard is in it: each rank's pages are its own, and a
        process-local tier (nvme) keeps one directory per namespace, so two ranks on
        one machine never contend for one."""
        everything = json.dumps(
            {
                "model": self.model,
                "dtype": self.dtype,
                "layout": self.layout,
                "page_size": self.page_size,
                "part_bytes": self.part_bytes,
                "parts_per_page": self.parts_per_page,
                "mla": self.is_mla,
                "tp": 1 if self.is_mla else self.tp_size,  # MLA pages are rank-replicated
                "pp": self.pp_size,
                # only where regions differ in size: every other namespace is as before
                **({"region_bytes": list(self.region_bytes)} if self.region_bytes else {}),
            },
            sort_keys=True,
        )
        digest = hashlib.sha256(everything.encode()).hexdigest()[:12]
        return (
            f"sglang:{self.model}:{self.dtype}:{self.page_size}t:{self.layout}:"
            f"{self.shard}:{digest}"
        )


@dataclass(frozen=True)
class ChainSettings:
    """A validated extra config: the tiers in chain order and how to call them."""

    tiers: tuple[TierConfig, ...]
    names: tuple[str, ...]
    namespace: str
    lookup_timeout: float
    quotas: dict[str, TierQuotas] = field(default_factory=dict)
    """Per-tenant quotas by tier name (`SyncChain(quotas=...)`)."""


def _problem(where: str, text: str) -> ConfigError:
    return ConfigError([f"{where}{text}"], source=SOURCE)


def check_keys(extra: Mapping[str, Any]) -> None:
    """Refuse a key neither tierkv nor SGLang's loader reads (a typo would otherwise
    be ignored), and a config without `interface_v1` (SGLang would then drive the
    backend through its copying legacy calls, which tierkv does not serve)."""
    unknown = sorted(set(extra) - set(OUR_KEYS) - set(SGLANG_KEYS))
    if unknown:
        raise _problem(
            f"extra_config.{unknown[0]}",
            f": unknown field (tierkv reads {', '.join(OUR_KEYS)}; SGLang reads "
            f"{', '.join(SGLANG_KEYS)})",
        )
    if not extra.get("interface_v1"):
        raise _problem(
            "extra_config.interface_v1",
            ": must be 1: tierkv reads and writes SGLang's host pool in place "
            "(batch_get_v1 / batch_set_v1); without it SGLang uses its copying legacy "
            'calls, which tierkv does not serve. Add "interface_v1": 1',
        )


def resolve(
    extra: Mapping[str, Any],
    geometry: PoolGeometry,
    *,
    env: Mapping[str, str] | None = None,
) -> ChainSettings:
    """Validate the extra config against `geometry`; `ConfigError` names every problem
    by its path inside the extra config (or the chain file)."""
    check_keys(extra)
    inline, chain = extra.get("tiers"), extra.get("chain")
    if (inline is None) == (chain is None):
        raise _problem(
            "extra_config",
            ': give exactly one of "tiers" (a list of tier sections, e.g. [{"type": '
            '"nvme", "path": ..., "capacity": ...}]) or "chain" (a tierkv YAML file)',
        )
    namespace = extra.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not namespace.strip()):
        raise _problem("extra_config.namespace", f": {namespace!r} must be a non-empty string")
    lookup = _lookup_timeout(extra.get("lookup_timeout"))
    tenants = check_inline_tenants(extra.get("tenants"), "extra_config.tenants", ENGINE)
    if inline is not None:
        if not isinstance(inline, list) or not inline:
            raise _problem("extra_config.tiers", f": expected a non-empty list, got {inline!r}")
        chain_of = _chain_of(inline, geometry, namespace, tenants)
        try:
            config = parse_config(chain_of, source=SOURCE, env=env)
        except ConfigError as exc:  # say the paths as the user wrote them
            problems = [as_written(p, "extra_config.") for p in exc.problems]
            raise type(exc)(problems, source=exc.source) from None
        default = geometry.default_namespace()
    else:
        if tenants is not None:
            raise _problem(
                "extra_config.tenants",
                f": only beside inline tiers; with a chain file, write its quotas in the "
                f"file ({chain}: tenants.quotas)",
            )
        config = load_config(str(chain), env=env)  # errors name the file and YAML path
        if not config.tiers:
            raise _problem("extra_config.chain", f": {chain} lists no tiers")
        _check_isolation(config, str(chain))
        # the file's namespace (a tenant, say) plus the model and layout: two models
        # pointed at one chain file never read each other's pages
        default = f"{config.namespace}|{geometry.default_namespace()}"
        if lookup is None and "lookup_timeout" in config.model_fields_set:
            lookup = config.lookup_timeout  # the file's own, not the embedded cache's 50 ms
    where = "extra_config.tiers" if inline is not None else f"{chain}: tiers"
    for i, tier in enumerate(config.tiers):
        _check_policy(tier, f"{where}[{i}]")
        _check_shared(tier, geometry, f"{where}[{i}]")
    quotas_at = "extra_config.tenants.quotas" if inline is not None else f"{chain}: tenants.quotas"
    return ChainSettings(
        tiers=tuple(config.tiers),
        names=tuple(config.tier_names()),
        namespace=namespace or default,
        lookup_timeout=LOOKUP_TIMEOUT if lookup is None else lookup,
        quotas=tier_quotas(config, quotas_at, ENGINE),
    )


def _lookup_timeout(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except (ValueError, TypeError) as exc:
        raise _problem("extra_config.lookup_timeout", f": {exc}") from None


def _chain_of(
    inline: list[Any],
    geometry: PoolGeometry,
    namespace: str | None,
    tenants: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A chain for `parse_config` whose layout is the pool's: one block per region
    (and the inline `tenants`, whose quotas it checks against the tiers)."""
    return {
        "namespace": namespace or "sglang",
        "layout": {
            "block_bytes": geometry.part_bytes,
            "groups": [{"kind": "full", "block_size": geometry.page_size}],
        },
        "primary": {"capacity": geometry.part_bytes},
        "tiers": inline,
        **({"tenants": tenants} if tenants is not None else {}),
    }


def _check_isolation(config: CacheConfig, chain: str) -> None:
    """`tenants.isolate` is kept by `TieredCache`, which gives each tenant keys of its
    own at its calls (`tierkv.cache.isolation`); SGLang's tiers are driven with SGLang's
    page hashes as they come. Those fold a request's cache_salt, extra_key and LoRA in,
    but not a tenant an `extra_info` names: so the promise could not be kept here."""
    if config.tenants.isolate:
        raise _problem(
            f"{chain}: tenants.isolate",
            ": true is not available under SGLang: tierkv drives its tiers with SGLang's "
            "page hashes as they come, which keep tenants apart only by what SGLang folds "
            "into them (a request's cache_salt, extra_key, LoRA), not by a tenant named in "
            "extra_info. Give each tenant its own cache_salt, and remove the field",
        )


def _check_policy(tier: TierConfig, where: str) -> None:
    """SGLang writes every page it backs up to its storage at once: every tier is
    written through; a policy that would hold pages back has nothing to act on."""
    if tier.write_policy != "write_through":
        raise _problem(
            f"{where}.write_policy",
            f": {tier.write_policy!r} is not available under SGLang, which writes every "
            "page it backs up to its storage layer at once (write_through); remove the field",
        )
    if tier.admission != "all":
        raise _problem(
            f"{where}.admission",
            f": {tier.admission!r} is not available under SGLang, which decides itself "
            "which pages to back up (its --hicache-write-policy); remove the field",
        )


LOCAL_TYPES = ("nvme", "memory")
"""Tier types one process owns (a directory it locks, its own memory)."""


def _check_shared(tier: TierConfig, geometry: PoolGeometry, where: str) -> None:
    """SGLang writes an MLA model's pages from one TP rank only; the other ranks read
    them, which a tier one process owns cannot give them."""
    if geometry.is_mla and geometry.tp_size > 1 and tier.type in LOCAL_TYPES:
        raise _problem(
            f"{where}.type",
            f": a {tier.type!r} tier belongs to one process, but SGLang writes an MLA "
            f"model's pages from TP rank 0 only (tp_size={geometry.tp_size}); the other "
            "ranks could never read them. Use a tier every rank reaches (redis, s3)",
        )


def rank_suffix(
    *,
    model: str | None,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    cp_rank: int = 0,
    cp_size: int = 1,
    is_mla: bool = False,
) -> str:
    """The suffix SGLang's own file backend gives a page of this rank: MLA pages are
    replicated across TP ranks and shared (one writer); MHA pages are each rank's own
    head shard."""
    name = "-".join(model.split("/")) if model else ""
    shard = f"_{pp_size}_{pp_rank}" if pp_size > 1 else ""
    if cp_size > 1:
        shard += f"_cp{cp_rank}_{cp_size}"
    return f"_{name}{shard}" if is_mla else f"_{name}_{tp_rank}_{tp_size}{shard}"
