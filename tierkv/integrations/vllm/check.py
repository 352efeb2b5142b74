"""`tierkv vllm check`: a `--kv-transfer-config` read as vLLM will read it, offline.

The JSON goes through vLLM's own parser (`TypeAdapter(KVTransferConfig)`, after vLLM's
expansion of human-readable numbers), its spec factory picks the spec, its tier
factory resolves every `secondary_tiers` entry's type, and each `tierkv` entry gets
exactly the keyword arguments vLLM's factory would pass (`type`, `module_path` and
`backpressure` taken out) and goes through the adapter's resolver, so a mistake reads
as vLLM's start-up would say it, at the path it was written. Nothing is opened,
connected or written.

What the transfer config does not say (the model, its dtype, the bytes of a chunk
row, the parallel layout) the caller gives as a `Geometry`; the namespace printed is
the one an engine of exactly that geometry gets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.contract.errors import ConfigError, TierKVError
from tierkv.integrations.quotas import quotas_text
from tierkv.integrations.vllm.settings import VllmGeometry, resolve_entry

EXTRA = "kv_connector_extra_config"


@dataclass(frozen=True)
class Geometry:
    """The engine facts a transfer config leaves out (defaults: a 2 MiB row of one
    16-token block, TP1)."""

    model: str = "MODEL"
    dtype: str = "bfloat16"
    tokens_per_block: int = 16
    blocks_per_chunk: int = 1
    row_bytes: int = 2 << 20
    tp: int = 1
    parallelism_agnostic: bool = False
    # per KV group, as vLLM's offloading config states it: None for full attention,
    # else the sliding window in chunks (a Mamba state group: 1)
    windows: tuple[int | None, ...] = (None,)


def parse_groups(text: str) -> tuple[int | None, ...]:
    """`--groups`: each KV group's attention, comma-separated: `full`, `window:N` (a
    sliding window of N chunks) or `state` (a recurrent state: one chunk)."""
    windows: list[int | None] = []
    for item in (part.strip() for part in text.split(",")):
        kind, _, arg = item.partition(":")
        if kind == "full" and not arg:
            windows.append(None)
        elif kind == "state" and not arg:
            windows.append(1)
        elif kind == "window" and arg.isdigit():
            windows.append(int(arg))
        else:
            raise ValueError(
                f"{item!r} is not a KV group; use full, window:N (N chunks) or state, "
                "comma-separated, e.g. full,window:32"
            )
    return tuple(windows)


@dataclass
class CheckedTier:
    """One `secondary_tiers` entry as vLLM would build it."""

    where: str
    vllm_type: str
    tierkv: dict[str, Any] | None = None  # for a tierkv entry: what it resolved to


@dataclass
class CheckReport:
    connector: str
    spec: str
    cpu_bytes_to_use: int | None
    tiers: list[CheckedTier] = field(default_factory=list)


def _problem(where: str, text: str) -> ConfigError:
    return ConfigError([f"{where}{text}"], source="--kv-transfer-config")


def read_config_text(value: str) -> str:
    """The JSON itself, or the text of the file `value` names (`@FILE` or a path, as
    the SGLang and LMCache checks read it)."""
    if value.lstrip().startswith("{"):
        return value
    path = Path(value[1:] if value.startswith("@") else value)
    if not path.is_file():
        raise _problem(
            "--kv-transfer-config",
            f": {value!r} is neither a JSON object nor a file (pass the JSON in quotes)",
        )
    return path.read_text(encoding="utf-8")


VLLM_TESTED = "0.33.0"
"""The vLLM release requirements-vllm.txt pins, named in the install hint."""


class VLLMMissing(TierKVError):
    """vLLM cannot be imported: not a config problem (exit 1), and the message says
    how to get it."""


def _vllm() -> Any:
    try:
        from vllm.config import KVTransferConfig
        from vllm.engine import arg_utils
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError as exc:
        raise VLLMMissing(
            f"vLLM is not installed here ({exc}): the check reads the config with vLLM's "
            "own parser. Run it in the environment vLLM serves from, or install the vLLM "
            "tierkv is tested with: `bash scripts/setup-vllm.sh` in a checkout (the pinned "
            "requirements-vllm.txt, into .venv), or `pip install vllm==" + VLLM_TESTED + "`"
        ) from None
    return KVTransferConfig, arg_utils, OffloadingSpecFactory, SecondaryTierFactory


def _offloading_config(geometry: Geometry) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    g = geometry
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(
                tokens_per_block=g.tokens_per_block,
                layer_names=(f"layer{i}",),
                group_id=i,
                sliding_window_size_in_chunks=window,
            )
            for i, window in enumerate(g.windows)
        ),
        worker_kv_bytes_per_block=g.row_bytes // g.tp // g.blocks_per_chunk,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="tierkv-vllm-check",
        model=OffloadingModelConfig(name=g.model, dtype=g.dtype),
        cache=OffloadingCacheConfig(
            tokens_per_hash=g.tokens_per_block, blocks_per_chunk=g.blocks_per_chunk
        ),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=g.tp,
            tp_size=g.tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=g.parallelism_agnostic,
        ),
    )


def check(value: str, geometry: Geometry) -> CheckReport:
    """Parse and resolve `value` (JSON or a file of it). Raises ConfigError with the
    path of the first problem."""
    from types import SimpleNamespace

    from tierkv.integrations.vllm import register
    from tierkv.integrations.vllm.settings import geometry_of

    kv_transfer_config, arg_utils, spec_factory, tier_factory = _vllm()
    register()  # what vLLM's plugin loading does at start-up
    config = _parse(read_config_text(value), kv_transfer_config, arg_utils)
    if config.kv_connector != "OffloadingConnector":
        raise _problem(
            "kv_connector",
            f": {config.kv_connector!r}; tierkv tiers plug into vLLM's OffloadingConnector",
        )
    extra = config.kv_connector_extra_config or {}
    spec = _tiering_spec(extra, spec_factory)
    entries = extra.get("secondary_tiers", [])
    if not isinstance(entries, list):
        raise _problem(f"{EXTRA}.secondary_tiers", ": must be a list of tier entries")
    cpu = extra.get("cpu_bytes_to_use")
    report = CheckReport(config.kv_connector, spec, int(cpu) if isinstance(cpu, int) else None)
    geo = geometry_of(SimpleNamespace(config=_offloading_config(geometry)), geometry.row_bytes)
    for i, entry in enumerate(entries):
        where = f"{EXTRA}.secondary_tiers[{i}]"
        report.tiers.append(_check_entry(where, entry, tier_factory, geo))
    return report


def _parse(text: str, kv_transfer_config: Any, arg_utils: Any) -> Any:
    """`text` as vLLM's command line reads `--kv-transfer-config`: human-readable
    numbers expanded, then validated as its `KVTransferConfig`."""
    expand = getattr(arg_utils, "_expand_json_human_readable_numbers", lambda s: s)
    text = expand(text)  # `80G` as vLLM's command line reads it
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise _problem("--kv-transfer-config", f": not JSON: {exc}") from None
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(kv_transfer_config).validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise _problem(where, f": {first.get('msg')} (as vLLM's --kv-transfer-config)") from None


def _tiering_spec(extra: Mapping[str, Any], spec_factory: Any) -> str:
    """The name of the spec vLLM's factory picks for `extra`, which must be the one
    that takes secondary tiers."""
    try:
        spec_cls = spec_factory.get_spec_cls(extra)
    except Exception as exc:
        raise _problem(f"{EXTRA}.spec_name", f": {exc}") from None
    if spec_cls.__name__ != "TieringOffloadingSpec":
        raise _problem(
            f"{EXTRA}.spec_name",
            f": {spec_cls.__name__} takes no secondary tiers; use TieringOffloadingSpec",
        )
    return str(spec_cls.__name__)


def _check_entry(where: str, entry: Any, tier_factory: Any, geo: VllmGeometry) -> CheckedTier:
    """One `secondary_tiers` entry: its type through vLLM's tier factory, and a
    `tierkv` entry through the adapter's resolver with the keyword arguments vLLM's
    factory would pass it."""
    if not isinstance(entry, Mapping) or not entry.get("type"):
        raise _problem(where, ": each entry is an object with a `type`")
    try:
        tier_factory.get_tier_class(dict(entry))
    except Exception as exc:
        raise _problem(f"{where}.type", f": {exc}") from None
    vllm_type = str(entry["type"])
    checked = CheckedTier(where, vllm_type)
    if vllm_type == "tierkv":
        kwargs = {
            k: v for k, v in entry.items() if k not in ("type", "module_path", "backpressure")
        }
        resolved = resolve_entry(kwargs, geo, where=where)
        tier = resolved.tier
        checked.tierkv = {
            "type": tier.type,
            "name": resolved.name,
            "namespace": resolved.namespace,
            "medium": resolved.medium,
            "locality": resolved.locality,
            "capacity": int(getattr(tier, "capacity", 0) or 0) or None,
            "job_timeout": float(tier.job_timeout),
            "shutdown_grace": resolved.shutdown_grace,
            "drain_timeout": resolved.drain_timeout,
            "quotas": None if resolved.quotas is None else resolved.quotas.model_dump(),
        }
    return checked


def _groups_text(windows: tuple[int | None, ...]) -> str:
    return ",".join("full" if w is None else f"window:{w}" for w in windows)


def render(report: CheckReport, geometry: Geometry) -> str:
    """The report for a person."""
    from tierkv.contract.units import format_size

    cpu = format_size(report.cpu_bytes_to_use) if report.cpu_bytes_to_use else "vLLM's default"
    g = geometry
    lines = [
        f"--kv-transfer-config: ok ({report.connector}, {report.spec}, primary {cpu})",
        f"assumed geometry (--model ... to change): model {g.model}, {g.dtype}, "
        f"{g.tokens_per_block} tokens x {g.blocks_per_chunk} blocks per chunk, "
        f"row {format_size(g.row_bytes)}, tp {g.tp}"
        + (", parallelism-agnostic" if g.parallelism_agnostic else "")
        + (f", KV groups {_groups_text(g.windows)}" if g.windows != (None,) else ""),
    ]
    for t in report.tiers:
        if t.tierkv is None:
            lines.append(f"  {t.where}: {t.vllm_type} (vLLM's own tier; not checked by tierkv)")
            continue
        d = t.tierkv
        size = f", capacity {format_size(d['capacity'])}" if d["capacity"] else ""
        place = d["medium"] + (f"/{d['locality']}" if d["locality"] else "")
        lines.append(
            f"  {t.where}: tierkv {d['type']} ({d['name']}), {place}{size}, "
            f"job_timeout {d['job_timeout']:g}s"
        )
        lines.append(f"    namespace {d['namespace']}")
        if d.get("quotas"):
            lines.append(f"    quotas {quotas_text(d['quotas'])}")
    if not report.tiers:
        lines.append("  no secondary tiers: vLLM offloads to its CPU primary only")
    return "\n".join(lines)
