"""`tierkv validate FILE [--connect [--create]]`: check a YAML chain, and its sizes
against this machine; `--connect` also opens each tier and times one lookup.

`--connect` creates nothing. A tier that keeps files (an nvme directory, a database
file) may create or rewrite them when it opens (a directory, a lock, a recovery that
evicts over capacity), so such a tier is not opened: its paths are checked instead
(there and writable, or creatable under a writable parent). `--create` opens it too,
creating what is missing, and says what it created. A tier's line is printed once its
check is over, and the file's closing `ok` only once every tier passed. An optional
tier (`required: false`) that cannot be used is reported as skipped, not failed: the
cache would run without it (and keep trying to open it), so it alone does not make
the exit code 1."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from tierkv.cli.common import UsageError, load_checked, one_line

if TYPE_CHECKING:
    from tierkv.config import CacheConfig
    from tierkv.contract.tier import TierConfig


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    va = sub.add_parser(
        "validate",
        parents=parents,
        help="validate a YAML tier chain",
        description="Check a YAML tier chain: UTF-8, no repeated keys, every field of "
        "every tier, unique tier names and paths, and sizes this machine can hold (the "
        "primary against its memory, each disk tier against its filesystem). Exit 2 "
        "with one line per problem, by YAML path; secrets are never shown. --connect "
        "opens each tier and times one lookup; it creates nothing: a tier that keeps "
        "files is not opened but its paths are checked, unless --create. Exit 1 when a "
        "required tier cannot be used; an optional one (required: false) is reported "
        "skipped, as the cache would run without it.",
    )
    va.add_argument("file", help="the YAML file")
    va.add_argument("--connect", action="store_true", help="also open each tier and time a lookup")
    va.add_argument(
        "--create",
        action="store_true",
        help="with --connect: also open the tiers that keep files, creating their "
        "directories or files when missing",
    )
    va.set_defaults(func=run)


def _missing_parent(path: Path) -> tuple[Path, bool]:
    """The nearest ancestor of `path` that exists, and whether a new entry can be made
    in it (a writable directory)."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent, parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)


def _check_paths(paths: dict[str, Path]) -> tuple[bool, str, list[Path]]:
    """Whether a tier's paths can be used without creating anything now, what to say,
    and the paths that do not exist yet."""
    missing: list[Path] = []
    said: list[str] = []
    for path in paths.values():
        if path.exists():
            if not os.access(path, os.W_OK):
                return False, f"{path} is not writable", missing
            said.append(f"{path} exists, writable")
            continue
        parent, creatable = _missing_parent(path)
        if not creatable:
            return False, f"{path} does not exist and {parent} is not a writable directory", missing
        missing.append(path)
        said.append(f"{path} does not exist (the tier creates it under {parent})")
    return True, "; ".join(said), missing


async def _open_and_look_up(tier_config: TierConfig, view: Any, entry: dict[str, Any]) -> None:
    """Open the tier, ask it about one key, close it; time both into `entry`."""
    from tierkv.contract.jobs import ReqContext
    from tierkv.contract.keys import make_offload_key
    from tierkv.registry import create_tier

    probe = make_offload_key(os.urandom(32), 0)
    step = "create"
    try:
        tier = create_tier(tier_config, view)
        step = "open"
        with anyio.fail_after(tier_config.job_timeout):
            t0 = time.perf_counter()
            await tier.open()
            entry["open_ms"] = (time.perf_counter() - t0) * 1e3
            try:
                step = "lookup"
                t0 = time.perf_counter()
                await tier.lookup([probe], ReqContext(request_id="tierkv-validate"))
                entry["lookup_ms"] = (time.perf_counter() - t0) * 1e3
                entry["ok"] = True
            finally:
                step = "close"
                await tier.close()
    except TimeoutError:
        entry["ok"] = False
        entry["error"] = f"{step} timed out after {tier_config.job_timeout:g}s"
    except Exception as exc:
        entry["ok"] = False
        entry["error"] = f"{step} failed: {type(exc).__name__}: {one_line(str(exc))}"


async def _connect(
    config: CacheConfig,
    *,
    create: bool = False,
    each: Callable[[dict[str, Any]], None] = lambda entry: None,
) -> list[dict[str, Any]]:
    """Check each tier on its own (`each` is called with its entry as soon as it is
    known): a tier without files is opened and asked about one key; a tier with files
    has its paths checked, and is opened only with `create`."""
    from tierkv.demo.scratch import path_fields
    from tierkv.primary import PrimaryTier

    primary = PrimaryTier(
        1, int(config.layout.block_bytes), pin_memory=False, namespace=config.namespace
    )
    results = []
    for name, tier_config in zip(config.tier_names(), config.tiers):
        entry: dict[str, Any] = {
            "tier": name,
            "type": tier_config.type,
            "ok": False,
            "required": tier_config.required,
        }
        paths = path_fields(tier_config)
        if paths:
            usable, said, missing = _check_paths(paths)
            entry["paths"] = said
            if not usable:
                entry["error"] = said
            elif create:
                await _open_and_look_up(tier_config, primary.view, entry)
                entry["created"] = [str(p) for p in missing if p.exists()]
            else:
                entry["ok"] = True
                entry["opened"] = False
        else:
            await _open_and_look_up(tier_config, primary.view, entry)
        each(entry)
        results.append(entry)
    return results


def _line(entry: dict[str, Any]) -> str:
    name = entry["tier"]
    if not entry["ok"] and not entry["required"]:
        return (
            f"  {name}: skipped (optional, required: false): {entry['error']}; the cache "
            "would run without it, and open it once it can"
        )
    if not entry["ok"]:
        return f"  {name}: FAILED: {entry['error']}"
    if entry.get("opened") is False:
        return f"  {name}: ok, not opened (it keeps files; --create opens it): {entry['paths']}"
    timing = f"open {entry['open_ms']:.1f} ms, lookup {entry['lookup_ms']:.2f} ms"
    created = f"; created {', '.join(entry['created'])}" if entry.get("created") else ""
    return f"  {name}: ok ({timing}){created}"


def _quota_lines(config: CacheConfig) -> list[str]:
    """One line per tier with tenant quotas: what each tenant is held to, and whether
    the tier can enforce it (`tierkv.quotas.tiers`)."""
    from tierkv.quotas.tiers import can_enforce
    from tierkv.registry import get_tier_class

    types = dict(zip(config.tier_names(), (t.type for t in config.tiers)))
    lines = []
    for tier, section in config.tenants.quotas.items():
        parts = [f"{name} {amount} (guaranteed)" for name, amount in section.tenants.items()]
        if section.default is not None:
            parts.append(f"others {section.default} each (cap)")
        parts.append("borrowing free room" if section.borrow else "no borrowing")
        if tier in types and not can_enforce(get_tier_class(types[tier])):
            how = f"counted, not enforced: a {types[tier]} tier cannot name its victims"
        else:
            how = "enforced"
        lines.append(f"  quotas on {tier}: {', '.join(parts)}; {how}")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.create and not args.connect:
        raise UsageError("--create needs --connect")
    config = load_checked(args.file)
    names = config.tier_names()
    summary = (
        f"namespace {config.namespace!r}, {config.primary_blocks} primary blocks, "
        f"tiers: {', '.join(names) or 'none'}"
    )
    if not args.connect:
        print(f"{args.file}: ok ({summary})")
        for line in _quota_lines(config):
            print(line)
        return 0
    print(f"{args.file}: valid ({summary}); checking each tier:")
    for line in _quota_lines(config):
        print(line)
    results = anyio.run(
        lambda: _connect(config, create=args.create, each=lambda e: print(_line(e), flush=True))
    )
    failed = [r["tier"] for r in results if not r["ok"] and r["required"]]
    skipped = [r["tier"] for r in results if not r["ok"] and not r["required"]]
    if failed:
        print(f"tierkv: error: cannot use tier {', '.join(failed)}", file=sys.stderr)
        return 1
    if skipped:
        print(
            f"{args.file}: ok without the optional tier {', '.join(skipped)} (every "
            "required tier usable; the cache would run without it)"
        )
        return 0
    print(f"{args.file}: ok (every tier usable)")
    return 0
