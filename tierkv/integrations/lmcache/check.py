"""`tierkv lmcache check`: an `--l2-adapter` JSON read as LMCache's server and the
tierkv adapter will read it, offline.

The JSON's plugin fields are checked as LMCache's plugin loader reads them
(`type: plugin`, `module_path`, `class_name`), `adapter_params` goes through the
adapter's own `settings.resolve` (its tier sections through `tierkv validate`'s
parser). Where LMCache is installed, its own L2 config parser reads the JSON too and
its loader's class check runs (the class imports and is an `L2AdapterInterface`).
The tiers' sizes are checked against this machine as `tierkv validate` checks them.
Nothing is opened, connected or written. `round_trip` runs LMCache's own check mode
(`test_l2_adapter`: lookup, store, lookup, load, compare) on the adapter, which does
open the tiers and write a few objects: in a temporary directory under a tier's path
(removed afterwards), and deleted from every tier before the adapter closes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.config.machine import fit_problems
from tierkv.contract.errors import ConfigError
from tierkv.driver.checks import backstop_after
from tierkv.integrations.lmcache.settings import resolve
from tierkv.integrations.quotas import quotas_text
from tierkv.quotas.config import TierQuotas

MODULE = "tierkv.integrations.lmcache"
CLASS = "TierkvL2Adapter"
SOURCE = "--l2-adapter"
SLOW_CALL = 10.0
"""Seconds past which a warning says a task may take that long to fail."""


@dataclass
class CheckReport:
    namespace: str
    task_deadline_s: float
    lookup_timeout_s: float
    object_bytes: list[int]
    tiers: list[dict[str, Any]] = field(default_factory=list)
    lmcache_parsed: bool | None = None  # None: LMCache is not installed here
    warnings: list[str] = field(default_factory=list)


def read_spec(value: str) -> dict[str, Any]:
    """The JSON itself, or a file holding it (`@FILE` or a path)."""
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value[1:] if value.startswith("@") else value)
        if not path.is_file():
            raise ConfigError(
                [f"{value!r} is neither a JSON object nor a file (pass the JSON in quotes)"],
                source=SOURCE,
            )
        text = path.read_text(encoding="utf-8")
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([f"not JSON: {exc}"], source=SOURCE) from None
    if not isinstance(spec, dict):
        raise ConfigError([f"expected a JSON object, got {type(spec).__name__}"], source=SOURCE)
    return spec


def check(value: str) -> CheckReport:
    """Read and resolve `value`. Raises ConfigError naming the first bad path."""
    spec = read_spec(value)
    want = {"type": "plugin", "module_path": MODULE, "class_name": CLASS}
    for key, expected in want.items():
        if spec.get(key) not in (expected, f"{MODULE}.adapter" if key == "module_path" else None):
            raise ConfigError(
                [
                    f"{key}: {spec.get(key)!r}; LMCache loads tierkv's adapter with "
                    f"{key} {expected!r}"
                ],
                source=SOURCE,
            )
    unknown = sorted(set(spec) - {*want, "adapter_params", "config_class_name"})
    if unknown:
        raise ConfigError([f"{unknown[0]}: not a field of a plugin L2 adapter"], source=SOURCE)
    params = spec.get("adapter_params") or {}
    settings = resolve(params)
    problems = fit_problems(None, list(enumerate(settings.tiers)))
    if problems:  # as `tierkv validate` checks them against this machine
        where = "adapter_params." if "tiers" in params else f"{params.get('chain')}: "
        raise ConfigError([where + p for p in problems], source=SOURCE)
    slowest = max(float(t.job_timeout) for t in settings.tiers)
    report = CheckReport(
        namespace=settings.namespace,
        task_deadline_s=backstop_after(slowest),
        lookup_timeout_s=settings.lookup_timeout,
        object_bytes=list(settings.object_bytes),
        tiers=[
            {
                "name": name,
                "type": t.type,
                "job_timeout_s": float(t.job_timeout),
                "claim_lease_s": float(t.claim_lease),
                "quotas": _quotas(settings.quotas.get(name)),
            }
            for name, t in zip(settings.names, settings.tiers)
        ],
        lmcache_parsed=_parse_with_lmcache(spec),
    )
    if report.task_deadline_s > SLOW_CALL:
        report.warnings.append(
            f"a store or load task on a hung tier fails after {report.task_deadline_s:g}s "
            f"(job_timeout {slowest:g}s plus the driver's grace); LMCache's prefetch waits "
            "that long for it. Consider job_timeout: 5s in each tier section"
        )
    if not settings.object_bytes:
        report.warnings.append(
            "no object_bytes: the tiers of each object size open when LMCache first stores "
            "or loads such an object (or with the server, for sizes an nvme tier's path "
            "holds), so after a restart lookups of other sizes miss until then (give the "
            'sizes, e.g. "object_bytes": ["2MiB"], to open them with the server)'
        )
    return report


def _quotas(quotas: TierQuotas | None) -> dict[str, Any] | None:
    return None if quotas is None else quotas.model_dump()


def _parse_with_lmcache(spec: dict[str, Any]) -> bool | None:
    """LMCache's own parser and its loader's class check; None where LMCache is not
    installed."""
    try:
        import argparse
        import importlib

        from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
        from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
    except Exception:
        return None
    try:
        parsed = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    except Exception as exc:
        raise ConfigError([f"LMCache refuses it: {exc}"], source=SOURCE) from None
    config = parsed.adapters[0]
    cls = getattr(importlib.import_module(config.module_path), config.class_name)
    if not (isinstance(cls, type) and issubclass(cls, L2AdapterInterface)):
        raise ConfigError([f"{config.class_name} is not an L2AdapterInterface"], source=SOURCE)
    return True


def round_trip(value: str, model: str = "tierkv/check") -> str:
    """LMCache's own `test_l2_adapter` check mode on the adapter (opens the tiers and
    writes 5 small objects); its printed report. Nothing is left behind: a tier that
    keeps files keeps them in a temporary directory made in its path (its disk, the
    one a server would use), removed afterwards, and the objects are deleted from
    every tier before the adapter closes (a Redis, a bucket)."""
    import asyncio
    import io

    from lmcache.v1.check import check_mode_test_l2_adapter as mode

    out = io.StringIO()
    with (
        _in_scratch(read_spec(value)) as spec,
        _deleting_what_it_stores(mode),
        contextlib.redirect_stdout(out),
    ):
        asyncio.run(mode.run_test_mode(model, l2_adapter=[json.dumps(spec)], num_keys=5))
    return out.getvalue()


@contextlib.contextmanager
def _in_scratch(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`spec` with its tiers inline (a `chain` file's sections read into `tiers`, its
    namespace and lookup timeout kept), every path a tier keeps files at moved into
    a fresh `.tierkv-check-*` directory under it; the directories are removed on the
    way out."""
    import shutil

    from tierkv.bench.scratch import make_scratch
    from tierkv.demo.scratch import moved_values, path_fields

    params = dict(spec.get("adapter_params") or {})
    settings = resolve(params)
    if "chain" in params:
        import yaml

        chain = yaml.safe_load(Path(str(params.pop("chain"))).read_text(encoding="utf-8"))
        params["tiers"] = chain["tiers"]
        params["namespace"] = settings.namespace
        params["lookup_timeout"] = settings.lookup_timeout
    made: list[Path] = []
    try:
        sections = []
        for name, tier, section in zip(settings.names, settings.tiers, params["tiers"]):
            section = dict(section)
            moved: dict[str, Path] = {}
            for key, old in path_fields(tier).items():  # `path`, or `paths[i]` each
                scratch = make_scratch(
                    name,
                    key,
                    old,
                    "tierkv lmcache check --round-trip writes its objects",
                    prefix=".tierkv-check-",
                )
                made.append(scratch)
                moved[key] = scratch / (old.name or key)
            section.update(moved_values(section, moved))
            sections.append(section)
        yield {**spec, "adapter_params": {**params, "tiers": sections}}
    finally:
        for scratch in made:
            shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _deleting_what_it_stores(mode: Any) -> Iterator[None]:
    """While LMCache's check mode runs: every adapter it builds deletes the objects
    it stored before it closes (the check mode itself leaves them)."""
    build = mode.create_l2_adapter

    def create(*args: Any, **kwargs: Any) -> Any:
        adapter = build(*args, **kwargs)
        stored: list[Any] = []
        submit, close = adapter.submit_store_task, adapter.close

        def submit_store_task(keys: list[Any], objects: list[Any]) -> int:
            stored.extend(keys)
            return int(submit(keys, objects))

        def close_deleting() -> None:
            try:
                if stored and hasattr(adapter, "delete"):
                    adapter.delete(list(stored))
            finally:
                close()

        adapter.submit_store_task = submit_store_task
        adapter.close = close_deleting
        return adapter

    mode.create_l2_adapter = create
    try:
        yield
    finally:
        mode.create_l2_adapter = build


def render(report: CheckReport) -> str:
    lines = [
        "ok: tierkv below LMCache's L1 (server mode, L2 adapter)",
        f"  namespace: {report.namespace}|obj<size> (one tier chain per object size)",
        "  keys: model, kv_rank, cache_salt and chunk hash hashed (blake2b-128) + group",
        f"  tasks: a store or load fails by {report.task_deadline_s:g}s, a lookup misses "
        f"after {report.lookup_timeout_s:g}s",
        "  tiers (loads try them in order; stores write every one):",
    ]
    for t in report.tiers:
        lines.append(
            f"    {t['name']}: {t['type']}, job_timeout {t['job_timeout_s']:g}s, "
            f"locks last at most {t['claim_lease_s']:g}s"
        )
        if t.get("quotas"):
            lines.append(f"      quotas {quotas_text(t['quotas'])}")
    if report.object_bytes:
        lines.append(f"  opened at start for objects of {report.object_bytes} bytes")
    if report.lmcache_parsed is None:
        lines.append("  LMCache is not installed here: its parser and loader were not run")
    else:
        lines.append(f"  LMCache parses it and loads {MODULE}.{CLASS}: yes")
    lines.extend(f"warning: {w}" for w in report.warnings)
    return "\n".join(lines)
