"""`tierkv lmcache check`: an `--l2-adapter` JSON read as LMCache's server and the tierkv
adapter will read it, offline (or, with `--round-trip`, LMCache's own adapter check)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    lm = sub.add_parser(
        "lmcache",
        parents=parents,
        help="tierkv inside LMCache: check an --l2-adapter JSON",
        description="tierkv as an L2 adapter of LMCache's server mode.",
    )
    lm_sub = lm.add_subparsers(dest="lmcache_command", required=True, metavar="COMMAND")
    lc = lm_sub.add_parser(
        "check",
        parents=parents,
        help="read an --l2-adapter JSON as LMCache and the adapter will, offline",
        description="Validate an `lmcache server --l2-adapter` JSON (the JSON or a file "
        "holding it) for tierkv's adapter: the plugin fields LMCache's loader reads and "
        "the tier chain in adapter_params, as the adapter will when the server starts; "
        "print the tiers, the namespace and each task's deadline. Where LMCache is "
        "installed its own parser and loader check run too. Opens nothing (unless "
        "--round-trip). Exit 2 with the path of the first problem.",
    )
    lc.add_argument("config", help="the JSON (quoted), or @FILE or FILE holding it")
    lc.add_argument(
        "--round-trip",
        action="store_true",
        help="also run LMCache's own check mode (test_l2_adapter) on the adapter: opens "
        "the tiers and stores, looks up and loads 5 small objects, then deletes them (a "
        "tier's files go to a temporary directory in its path, removed afterwards); "
        "exit 1 unless all 5 come back",
    )
    lc.add_argument("--json", action="store_true", help="print the report as JSON")
    lc.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from tierkv.integrations.lmcache.check import check, render, round_trip

    report = check(args.config)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(render(report))
    if args.round_trip:
        text = round_trip(args.config)
        print(text)
        if "Validation (content): 5/5" not in text:
            return 1
    return 0
