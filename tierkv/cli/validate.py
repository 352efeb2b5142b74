"""`tierkv validate FILE [--connect]`: check a YAML chain, and its sizes against this
machine; `--connect` also opens each tier and times one lookup."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio

from tierkv.cli.common import load_checked, one_line

if TYPE_CHECKING:
    from tierkv.config import CacheConfig


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    va = sub.add_parser(
        "validate",
        parents=parents,
        help="validate a YAML tier chain",
        description="Check a YAML tier chain: UTF-8, no repeated keys, every field of "
        "every tier, unique tier names and paths, and sizes this machine can hold (the "
        "primary against its memory, each disk tier against its filesystem). Exit 2 "
        "with one line per problem, by YAML path; secrets are never shown.",
    )
    va.add_argument("file", help="the YAML file")
    va.add_argument("--connect", action="store_true", help="also open each tier and time a lookup")
    va.set_defaults(func=run)


async def _connect(config: CacheConfig) -> list[dict[str, Any]]:
    """Open each tier on its own, ask it about one key, close it; time both."""
    import os

    from tierkv.contract.jobs import ReqContext
    from tierkv.contract.keys import make_offload_key
    from tierkv.primary import PrimaryTier
    from tierkv.registry import create_tier

    primary = PrimaryTier(
        1, int(config.layout.block_bytes), pin_memory=False, namespace=config.namespace
    )
    probe = make_offload_key(os.urandom(32), 0)
    results = []
    for name, tier_config in zip(config.tier_names(), config.tiers):
        entry: dict[str, Any] = {"tier": name, "type": tier_config.type, "ok": False}
        step = "create"
        try:
            tier = create_tier(tier_config, primary.view)
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
        results.append(entry)
    return results


def run(args: argparse.Namespace) -> int:
    config = load_checked(args.file)
    names = config.tier_names()
    print(
        f"{args.file}: ok (namespace {config.namespace!r}, {config.primary_blocks} primary "
        f"blocks, tiers: {', '.join(names) or 'none'})"
    )
    if not args.connect:
        return 0
    results = anyio.run(_connect, config)
    for r in results:
        if r["ok"]:
            print(f"  {r['tier']}: ok (open {r['open_ms']:.1f} ms, lookup {r['lookup_ms']:.2f} ms)")
        else:
            print(f"  {r['tier']}: FAILED: {r['error']}")
    failed = [r["tier"] for r in results if not r["ok"]]
    if failed:
        print(f"tierkv: error: cannot use tier {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
