"""`tierkv bench`: each tier's speed as a ratio to its raw medium, and the
orchestrator's own cost (`--gpu`: the GPU hop per copy backend)."""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from tierkv.cli.common import (
    UsageError,
    block_size,
    chain,
    non_negative,
    positive,
    print_json,
    size,
)
from tierkv.cli.progress import Progress

QUICK = {"total": 32 << 20, "keys": 100_000}
"""`tierkv bench` with no flags: seconds, well under 1 GB on a small machine."""
FULL = {"total": 256 << 20, "keys": 1_000_000}
"""`tierkv bench --full`: the sizes the manual's tables were measured with."""


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        parents=parents,
        # argparse would show the optional `trace` subcommand as a required positional
        usage="%(prog)s [options]\n       %(prog)s trace FILE [options]  (see bench trace -h)",
        help="each tier's speed as a ratio to its raw medium",
        description="Store then load blocks through each medium of a chain and through "
        "the medium's plain client in the same run; report MB/s, the ratio and latency; "
        "then the orchestrator's bookkeeping rate over many resident keys. Without "
        "flags a quick run (32MiB per medium); --full for the sizes the manual quotes. "
        "A tier that keeps no files (Redis, S3) is opened first: one that cannot be "
        "reached fails the run before anything is measured. A tier that keeps files "
        "(nvme) is measured in a temporary directory made in its path, removed "
        "afterwards; a path where nothing can be created fails the run (exit 1). "
        "The streaming phase (one request much larger than the primary) runs through "
        "the chain's nvme tier when it is among the media measured.",
    )
    bench.add_argument(
        "--config", metavar="FILE", help="YAML tier chain (default: primary + nvme in a temp dir)"
    )
    bench.add_argument(
        "--block-size", type=block_size, metavar="SIZE", default=1 << 20, help="default 1MiB"
    )
    bench.add_argument(
        "--total",
        type=size,
        metavar="SIZE",
        default=None,
        help="per medium, and per transfer with --gpu (32MiB; 256MiB with --full)",
    )
    bench.add_argument("--batch", type=positive, metavar="N", default=8, help="blocks per call (8)")
    bench.add_argument(
        "--concurrency", type=positive, metavar="N", default=8, help="calls in flight (8)"
    )
    bench.add_argument("--repeat", type=positive, metavar="N", default=3, help="repetitions (3)")
    bench.add_argument(
        "--tiers", metavar="NAMES", help="comma-separated media to measure (cpu,nvme,...)"
    )
    bench.add_argument(
        "--keys",
        type=non_negative,
        metavar="N",
        default=None,
        help="resident keys for the orchestrator measurement (100000; 1000000 with "
        "--full; 0 skips it)",
    )
    bench.add_argument(
        "--full",
        action="store_true",
        help="the full run the manual's tables quote: 256MiB per medium and 1000000 "
        "resident keys (minutes and a few GB); without it a quick run",
    )
    bench.add_argument(
        "--lookup-batch", type=positive, metavar="N", default=128, help="keys per call"
    )
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument(
        "--gpu", action="store_true", help="the GPU hop per copy backend (tierkv.gpu.bench)"
    )
    bench.set_defaults(func=run)
    from tierkv.cli import trace

    trace.add_parser(
        bench.add_subparsers(
            dest="bench_command",
            # the subcommand's usage line starts with this (argparse would build it from
            # bench's two-line usage above)
            prog=bench.prog,
            metavar="trace",
            title="optional subcommand",
            description="without one, bench measures the chain",
        ),
        parents,
    )


def run(args: argparse.Namespace) -> int:
    defaults = FULL if args.full else QUICK
    total = defaults["total"] if args.total is None else args.total
    if args.gpu:
        from tierkv.gpu.bench import run_gpu_bench

        return run_gpu_bench(total, args.repeat, args.json)
    from tierkv.bench import BenchOptions, UnknownMedium, bench_summary, run_bench
    from tierkv.bench.scratch import in_bench_scratch
    from tierkv.demo.report import render

    try:
        options = BenchOptions(
            block_bytes=args.block_size,
            total_bytes=total,
            batch=args.batch,
            concurrency=args.concurrency,
            repeat=args.repeat,
            media=tuple(args.tiers.split(",")) if args.tiers else None,
            orchestrator_keys=defaults["keys"] if args.keys is None else args.keys,
            lookup_batch=args.lookup_batch,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with (
        chain(args.config) as chosen,
        in_bench_scratch(chosen) as config,
        Progress(not args.json, None, "starting", command="bench") as progress,
    ):
        try:
            report = anyio.run(lambda: run_bench(config, options, progress=progress.update))
        except UnknownMedium as exc:
            raise UsageError(f"--tiers: {exc}") from None
    if args.json:
        print_json(report)
    else:
        render(bench_summary(report))
    return 0
