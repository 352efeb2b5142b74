"""`tierkv roundtrip`: store -> lookup -> load of random blocks through a
`TieredCache` of the chain, every byte checked (`tierkv.roundtrip`).

The chain runs as configured: each tier is written by its `write_policy` and
`admission`, and an optional tier (`required: false`) that cannot open is reported
skipped, as the cache runs without it. A round trip must not be fooled by an earlier
one, nor leave anything behind: its keys are hashed under a namespace of its own
(`<namespace>-roundtrip-<nonce>`, new every run), so a block an earlier run stored is
never read as this run's; the tiers' files (an nvme directory, a database file) go to
a temporary directory removed afterwards, and the blocks it wrote to a tier without
files (memory, Redis, S3) are removed when it ends. `--keep` uses the chain's own
paths and leaves the blocks where they are; the report says what it wrote where
either way.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from tierkv.cli.common import check_machine, positive, print_json

if TYPE_CHECKING:
    from tierkv.config import CacheConfig

ROUNDTRIP_CHAIN = """
namespace: tierkv
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
        description="Store random blocks through a TieredCache of the chain, flush, look "
        "them up and load them back, and check every byte: a quick end-to-end test of a "
        "chain as configured. Each tier is written by its write_policy and admission (a "
        "tier that writes only blocks looked up twice holds none of them: said, not "
        "failed), and an optional tier (required: false) that cannot open is reported "
        "skipped, as the cache runs without it. The keys live under a namespace of this "
        "run's own, so blocks of an earlier run are never mistaken for this one's. The "
        "tiers' files go to a temporary directory, removed afterwards, and blocks "
        "written to tiers without files are removed at the end; --keep uses the "
        "config's paths and leaves the blocks. Exit 1 if a block differs, a tier lost "
        "or never got a block it should hold, or a required tier cannot open.",
    )
    rt.add_argument(
        "--config", metavar="FILE", help="YAML tier chain (default: primary + memory tier)"
    )
    rt.add_argument(
        "--blocks", type=positive, metavar="N", default=64, help="blocks to store (default 64)"
    )
    rt.add_argument("--seed", type=int, default=0, help="seed for the block contents")
    rt.add_argument(
        "--keep",
        action="store_true",
        help="with --config: write to the tiers' own paths and leave the blocks there",
    )
    rt.add_argument("--json", action="store_true", help="machine-readable report")
    rt.set_defaults(func=run)


@contextlib.contextmanager
def _roundtrip_chain(path: str | None, *, keep: bool) -> Iterator[tuple[CacheConfig, str | None]]:
    """The chain to run on, under a namespace of this run's own, and the temporary
    directory its tiers' files are in (None with `keep`, or when no tier has files)."""
    from tierkv.config import load_config, parse_config
    from tierkv.demo.scratch import in_scratch, tier_paths

    if path is None:
        config = parse_config(ROUNDTRIP_CHAIN, source="built-in chain")
    else:
        config = load_config(path)
    config = config.model_copy(
        update={"namespace": f"{config.namespace}-roundtrip-{secrets.token_hex(4)}"}
    )
    if keep or not tier_paths(config):
        if path is not None:
            check_machine(config, path)
        yield config, None
        return
    with tempfile.TemporaryDirectory(prefix="tierkv-roundtrip-") as tmp:
        config = in_scratch(config, Path(tmp))
        if path is not None:
            check_machine(config, path)  # the sizes where the files will really be
        yield config, tmp


def run(args: argparse.Namespace) -> int:
    from tierkv.demo.scratch import tier_paths
    from tierkv.roundtrip import run_roundtrip

    with _roundtrip_chain(args.config, keep=args.keep) as (config, scratch):
        report = anyio.run(
            lambda: run_roundtrip(config, args.blocks, args.seed, remove_after=not args.keep)
        )
        report["namespace"] = config.namespace
        report["paths"] = tier_paths(config)
        report["temporary_directory"] = scratch
        report["kept"] = bool(args.keep)
    report["lines"].append(_where(report))
    if args.json:
        print_json(report)
    else:
        for line in report["lines"]:
            print(line)
    return 0 if report["ok"] else 1


def _where(report: dict[str, Any]) -> str:
    """What the round trip wrote where, and what is left of it."""
    wrote = f"  wrote {report['blocks']} blocks under namespace {report['namespace']!r}"
    filed = report["paths"]
    others = [name for name in report["tier_blocks"] if name not in filed]
    if report["kept"]:
        paths = "; ".join(f"{n} in {', '.join(p)}" for n, p in filed.items())
        return f"{wrote}, kept (--keep){': ' + paths if paths else ''}"
    said = []
    if report["temporary_directory"]:
        said.append(f"the tiers' files in {report['temporary_directory']} (temporary, removed)")
    if others:
        said.append(f"removed from {', '.join(others)} afterwards")
    return f"{wrote}; {'; '.join(said) or 'nothing kept'}"
