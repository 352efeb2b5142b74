"""The `tierkv` command.

    tierkv roundtrip [--config FILE]   store -> lookup -> load through a real chain
    tierkv validate FILE               check a YAML chain; errors name path and value
    tierkv plugins                     installed tier types

Exit codes: 0 ok, 2 bad usage or config, 1 runtime failure. Errors go to stderr in
one readable block; `--verbose` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Sequence

import anyio

from tierkv.config import CacheConfig, load_config, parse_config
from tierkv.errors import ConfigError
from tierkv.registry import installed_tiers
from tierkv.roundtrip import run_roundtrip

DEFAULT_CHAIN = """
namespace: tierkv-roundtrip
layout: {block_bytes: 256KiB, groups: [{kind: full, block_size: 16}]}
primary: {capacity: 4MiB, eviction: arc, pin_memory: auto}
tiers:
  - {type: memory, capacity: 64MiB}
"""


def _config(path: str | None) -> CacheConfig:
    return load_config(path) if path else parse_config(DEFAULT_CHAIN, source="built-in chain")


def _cmd_roundtrip(args: argparse.Namespace) -> int:
    config = _config(args.config)
    report = anyio.run(run_roundtrip, config, args.blocks, args.seed)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for line in report["lines"]:
            print(line)
    return 0 if report["ok"] else 1


def _cmd_validate(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    tiers = ", ".join(t.type for t in config.tiers) or "none"
    print(
        f"{args.file}: ok (namespace {config.namespace!r}, {config.primary_blocks} primary "
        f"blocks, tiers: {tiers})"
    )
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    for info in installed_tiers().values():
        origin = f"{info.distribution} {info.version}" if info.distribution else "registered"
        print(f"{info.type:<10} {info.target:<40} {origin}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierkv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", "-v", action="store_true", help="tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True)

    rt = sub.add_parser("roundtrip", help="store -> lookup -> load through a tier chain")
    rt.add_argument("--config", help="YAML tier chain (default: primary + memory tier)")
    rt.add_argument("--blocks", type=int, default=64, help="blocks to store (default 64)")
    rt.add_argument("--seed", type=int, default=0, help="seed for the block contents")
    rt.add_argument("--json", action="store_true", help="machine-readable report")
    rt.set_defaults(func=_cmd_roundtrip)

    va = sub.add_parser("validate", help="validate a YAML tier chain")
    va.add_argument("file")
    va.set_defaults(func=_cmd_validate)

    pl = sub.add_parser("plugins", help="list installed tier types")
    pl.set_defaults(func=_cmd_plugins)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        code: int = args.func(args)
        return code
    except ConfigError as exc:
        print(f"tierkv: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"tierkv: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
