"""`tierkv roundtrip`: store -> lookup -> load of random blocks through a chain, every
byte checked."""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from tierkv.cli.common import load_checked, positive, print_json
from tierkv.config import parse_config

ROUNDTRIP_CHAIN = """
namespace: tierkv-roundtrip
layout: {block_bytes: 256KiB, groups: [{kind: full, block_size: 16}]}
primary: {capacity: 4MiB, eviction: arc, pin_memory: auto}
tiers:
  - {type: memory, capacity: 64MiB}
"""


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    rt = sub.add_parser(
        "roundtrip",
        parents=parents,
        help="store -> lookup -> load of random blocks",
        description="Store random blocks through a chain, flush, look them up and load "
        "them back, and check every byte: a quick end-to-end test of a chain. Exit 1 if "
        "a block is missing or differs.",
    )
    rt.add_argument(
        "--config", metavar="FILE", help="YAML tier chain (default: primary + memory tier)"
    )
    rt.add_argument(
        "--blocks", type=positive, metavar="N", default=64, help="blocks to store (default 64)"
    )
    rt.add_argument("--seed", type=int, default=0, help="seed for the block contents")
    rt.add_argument("--json", action="store_true", help="machine-readable report")
    rt.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierkv.roundtrip import run_roundtrip

    config = (
        load_checked(args.config)
        if args.config
        else parse_config(ROUNDTRIP_CHAIN, source="built-in chain")
    )
    report = anyio.run(run_roundtrip, config, args.blocks, args.seed)
    if args.json:
        print_json(report)
    else:
        for line in report["lines"]:
            print(line)
    return 0 if report["ok"] else 1
