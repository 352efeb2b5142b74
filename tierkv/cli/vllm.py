"""`tierkv vllm check`: a `--kv-transfer-config` read as vLLM will, offline."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tierkv.cli.common import block_size, positive


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    vl = sub.add_parser(
        "vllm",
        parents=parents,
        help="tierkv inside vLLM: check a --kv-transfer-config",
        description="tierkv as vLLM's KV-offloading secondary tiers.",
    )
    vl_sub = vl.add_subparsers(dest="vllm_command", required=True, metavar="COMMAND")
    vc = vl_sub.add_parser(
        "check",
        parents=parents,
        help="read a --kv-transfer-config as vLLM will, offline",
        description="Parse a --kv-transfer-config with vLLM's own parser and factories, "
        "resolve every tierkv entry as the adapter will at start-up, and print the tier "
        "chain with each tier's medium, sizes and namespace. Opens nothing. Exit 2 with "
        "the path of the first problem. Run it where vLLM is installed.",
    )
    vc.add_argument("config", help="the JSON (quoted), or @FILE or FILE holding it")
    vc.add_argument("--model", default="MODEL", help="the served model's name (namespace)")
    vc.add_argument("--dtype", default="bfloat16", help="the KV cache dtype (bfloat16)")
    vc.add_argument("--tokens-per-block", type=positive, default=16, metavar="N", help="(16)")
    vc.add_argument("--blocks-per-chunk", type=positive, default=1, metavar="N", help="(1)")
    vc.add_argument(
        "--row-bytes",
        type=block_size,
        default=2 << 20,
        metavar="SIZE",
        help="bytes of one offloaded chunk on one worker x TP (2MiB)",
    )
    vc.add_argument("--tp", type=positive, default=1, metavar="N", help="tensor parallel size")
    vc.add_argument(
        "--parallelism-agnostic",
        action="store_true",
        help="the engine's layout is parallelism-agnostic (namespace without topology)",
    )
    vc.add_argument(
        "--groups",
        type=kv_groups,
        default=(None,),
        metavar="LIST",
        help="the model's KV groups, comma-separated: full, window:N (a sliding window "
        "of N chunks), state (Mamba); e.g. full,window:32 (full)",
    )
    vc.add_argument("--json", action="store_true", help="print the report as JSON")
    vc.set_defaults(func=run_check)


def kv_groups(text: str) -> tuple[int | None, ...]:
    from tierkv.integrations.vllm.check import parse_groups

    try:
        return parse_groups(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_check(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from tierkv.integrations.vllm.check import Geometry, check, render

    geometry = Geometry(
        model=args.model,
        dtype=args.dtype,
        tokens_per_block=args.tokens_per_block,
        blocks_per_chunk=args.blocks_per_chunk,
        row_bytes=args.row_bytes,
        tp=args.tp,
        parallelism_agnostic=args.parallelism_agnostic,
        windows=args.groups,
    )
    report = check(args.config, geometry)
    if args.json:
        print(json.dumps({"geometry": asdict(geometry), **asdict(report)}, indent=2))
    else:
        print(render(report, geometry))
    return 0
