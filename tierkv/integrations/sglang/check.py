"""`tierkv sglang check`: a `--hicache-storage-backend-extra-config` read as the backend
will read it at start-up, offline, for a model's geometry.

The JSON goes through the backend's own checks (`settings.check_keys`, `resolve`), its
tier sections through `tierkv validate`'s parser, against the page geometry SGLang's
host pool will have: the bytes and number of the regions its `get_page_buffer_meta`
reports per page, computed here as SGLang's MHA and MLA pools compute them. Where
SGLang is installed, its loader also loads the class the config names (as its
`dynamic` backend does: `issubclass(cls, HiCacheStorage)`). The tiers' sizes are
checked against this machine as `tierkv validate` checks them (a disk tier against the
filesystem under its path). Nothing is opened, connected or written.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.config.machine import fit_problems
from tierkv.contract.errors import ConfigError
from tierkv.contract.tier import TierConfig
from tierkv.driver.checks import backstop_after
from tierkv.integrations.quotas import quotas_text
from tierkv.integrations.sglang.settings import SOURCE, PoolGeometry, rank_suffix, resolve
from tierkv.quotas.config import TierQuotas
from tierkv.registry import get_tier_class

MODULE = "tierkv.integrations.sglang"
CLASS = "TierkvHiCacheStorage"
LAYOUTS = ("page_first", "page_first_direct", "layer_first", "page_head", "page_first_kv_split")
"""Every `--hicache-mem-layout` of SGLang 0.5.23 (page_head: MHA only;
page_first_kv_split: MLA only, SGLang's NPU pools)."""
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
SLOW_CALL = 5.0
"""Seconds past which a warning says SGLang's threads may wait that long per call."""


@dataclass(frozen=True)
class Model:
    """What the extra config does not say: the served model's KV geometry on one rank."""

    name: str = "MODEL"
    dtype: str = "bfloat16"
    page_size: int = 64
    layers: int = 32
    kv_heads: int = 8  # per TP rank (MHA)
    head_dim: int = 128  # MHA; for MLA, kv_lora_rank + qk_rope_head_dim (576)
    rope_dim: int = 64  # MLA's qk_rope_head_dim: V's width in page_first_kv_split
    layout: str = "page_first"
    mla: bool = False
    tp: int = 1

    def geometry(self) -> PoolGeometry:
        """The page regions SGLang's host pool reports for this model."""
        if self.layout not in LAYOUTS:
            raise ConfigError([f"--layout: {self.layout!r} is not one of {', '.join(LAYOUTS)}"])
        item = DTYPE_BYTES.get(self.dtype)
        if item is None:
            raise ConfigError([f"--dtype: {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}"])
        if self.layout == "page_first_kv_split" and not self.mla:
            raise ConfigError(["--layout: page_first_kv_split is SGLang's for MLA models only"])
        if self.layout == "page_head" and self.mla:
            raise ConfigError(["--layout: page_head is SGLang's for MHA models only"])
        heads = 1 if self.mla else self.kv_heads
        per_layer = self.page_size * heads * self.head_dim * item
        kv = 1 if self.mla else 2
        regions: tuple[int, ...] = ()
        if self.layout == "layer_first":
            part, parts = per_layer, kv * self.layers
        elif self.layout == "page_first_kv_split":  # K (latent) and V (rope), 2 buffers
            rope = self.page_size * self.rope_dim * item * self.layers
            regions = (per_layer * self.layers - rope, rope)
            part, parts = regions[0], 2
        else:
            part, parts = per_layer * self.layers, kv
        return PoolGeometry(
            model=self.name,
            dtype=self.dtype,
            layout=self.layout,
            page_size=self.page_size,
            part_bytes=part,
            parts_per_page=parts,
            is_mla=self.mla,
            tp_size=self.tp,
            region_bytes=regions,
        )


@dataclass
class CheckReport:
    namespace: str
    rank_suffix: str
    part_bytes: int
    parts_per_page: int
    call_deadline_s: float
    lookup_timeout_s: float
    tiers: list[dict[str, Any]] = field(default_factory=list)
    whole_pages: bool = False
    """A page is one block of all its regions (`regions.RegionPool` over a
    `GatherView`): several regions (any layout) and every tier `accepts_regions`."""
    page_bytes: int = 0
    region_bytes: list[int] = field(default_factory=list)
    """Each region's bytes where they differ (page_first_kv_split); else empty."""
    class_loaded: bool | None = None  # None: SGLang is not installed here
    warnings: list[str] = field(default_factory=list)


def read_extra(value: str) -> dict[str, Any]:
    """The JSON itself, or (as SGLang reads `@FILE`) the JSON, YAML or TOML in a file."""
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value[1:] if value.startswith("@") else value)
        if not path.is_file():
            raise ConfigError(
                [f"{value!r} is neither a JSON object nor a file (pass the JSON in quotes)"],
                source=SOURCE,
            )
        return _mapping(_read_file(path))
    try:
        return _mapping(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ConfigError([f"not JSON: {exc}"], source=SOURCE) from None


def _read_file(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            import tomllib  # type: ignore[import-not-found,unused-ignore]

            return tomllib.loads(text)
        import yaml  # JSON is YAML too

        return yaml.safe_load(text)
    except Exception as exc:
        raise ConfigError([f"{path}: cannot be read: {exc}"], source=SOURCE) from None


def _mapping(extra: Any) -> dict[str, Any]:
    if not isinstance(extra, dict):
        raise ConfigError([f"expected a JSON object, got {type(extra).__name__}"], source=SOURCE)
    return extra


def check(value: str, model: Model) -> CheckReport:
    """Read and resolve `value` for `model`. Raises ConfigError naming the first bad
    path."""
    extra = read_extra(value)
    _check_loader_fields(extra)
    geometry = model.geometry()
    settings = resolve(extra, geometry)
    check_fit(settings.tiers, "extra_config." if "tiers" in extra else f"{extra.get('chain')}: ")
    slowest = max(float(t.job_timeout) for t in settings.tiers)
    report = CheckReport(
        namespace=settings.namespace,
        rank_suffix=rank_suffix(
            model=model.name, tp_rank=0, tp_size=model.tp, pp_rank=0, pp_size=1, is_mla=model.mla
        ),
        part_bytes=geometry.part_bytes,
        parts_per_page=geometry.parts_per_page,
        call_deadline_s=backstop_after(slowest),
        lookup_timeout_s=settings.lookup_timeout,
        tiers=[
            {
                "name": name,
                "type": t.type,
                "job_timeout_s": float(t.job_timeout),
                "quotas": _quotas(settings.quotas.get(name)),
            }
            for name, t in zip(settings.names, settings.tiers)
        ],
        # a page of several regions, in any layout, is one block where every tier
        # accepts regions (`GatherView`: any regions at any places)
        whole_pages=geometry.parts_per_page > 1
        and all(get_tier_class(t.type).accepts_regions for t in settings.tiers),
        page_bytes=geometry.page_bytes,
        region_bytes=list(geometry.region_bytes),
        class_loaded=_load_class(extra),
    )
    if report.call_deadline_s > SLOW_CALL:
        report.warnings.append(
            f"a get or set may hold SGLang's I/O or backup thread {report.call_deadline_s:g}s "
            f"when a tier hangs (job_timeout {slowest:g}s plus the driver's grace); SGLang "
            "never interrupts it. Consider job_timeout: 2s in each tier section"
        )
    if geometry.parts_per_page > 8 and not report.whole_pages:
        report.warnings.append(
            f"layout {model.layout} gives {geometry.parts_per_page} regions of "
            f"{geometry.part_bytes} bytes per page, each its own block in every tier (a "
            "tier of the chain does not accept regions); with tiers that all do (nvme, "
            "memory, redis, s3) a page is one block in every layout"
        )
    return report


def _quotas(quotas: TierQuotas | None) -> dict[str, Any] | None:
    return None if quotas is None else quotas.model_dump()


def check_fit(tiers: Sequence[TierConfig], where: str) -> None:
    """The checks `tierkv validate` makes against this machine: every disk tier
    against the filesystem under its path (several on one filesystem together), a
    memory tier against the machine's memory. Paths are named as written (`where` is
    what comes before `tiers[i]`). SGLang's host pool is the primary: not checked."""
    problems = fit_problems(None, list(enumerate(tiers)))
    if problems:
        raise ConfigError([where + p for p in problems], source=SOURCE)


def _check_loader_fields(extra: dict[str, Any]) -> None:
    """The fields SGLang's `dynamic` loader reads, as the backend needs them."""
    want = {"backend_name": None, "module_path": MODULE, "class_name": CLASS}
    for key, value in want.items():
        if key not in extra:
            raise ConfigError(
                [f"extra_config.{key}: missing (SGLang's dynamic backend needs it)"],
                source=SOURCE,
            )
        if value is not None and extra[key] not in (value, f"{MODULE}.storage"):
            raise ConfigError(
                [f"extra_config.{key}: {extra[key]!r}; tierkv's backend is {value!r}"],
                source=SOURCE,
            )


def _load_class(extra: dict[str, Any]) -> bool | None:
    """Load the class as SGLang's loader does; None where SGLang is not installed."""
    try:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except Exception:
        return None
    StorageBackendFactory._load_backend_class(
        extra["module_path"], extra["class_name"], extra["backend_name"]
    )
    return True


def render(report: CheckReport, model: Model) -> str:
    lines = [
        f"ok: tierkv below SGLang's host pool for {model.name} ({model.dtype}, "
        f"{'MLA' if model.mla else 'MHA'}, TP {model.tp}, layout {model.layout})",
        f"  page: {model.page_size} tokens, {report.parts_per_page} regions of "
        + (
            " + ".join(str(b) for b in report.region_bytes)
            if report.region_bytes
            else f"{report.part_bytes}"
        )
        + " bytes, "
        + (
            "one tierkv block of them all (every tier accepts regions)"
            if report.whole_pages
            else "each a tierkv block"
        ),
        f"  namespace: {report.namespace}",
        f"  keys: SGLang's page hash + rank suffix {report.rank_suffix!r} (rank 0) + region",
        f"  calls: get/set answer within {report.call_deadline_s:g}s, "
        f"exists within {report.lookup_timeout_s:g}s (a miss after that)",
        "  tiers (gets try them in order; sets write every one):",
    ]
    for t in report.tiers:
        lines.append(f"    {t['name']}: {t['type']}, job_timeout {t['job_timeout_s']:g}s")
        if t.get("quotas"):
            lines.append(f"      quotas {quotas_text(t['quotas'])}")
    if report.class_loaded is None:
        lines.append("  SGLang is not installed here: the backend class was not loaded")
    else:
        lines.append(f"  SGLang loads {MODULE}.{CLASS}: yes")
    lines.extend(f"warning: {w}" for w in report.warnings)
    return "\n".join(lines)
