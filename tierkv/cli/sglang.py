"""`tierkv sglang check`: a `--hicache-storage-backend-extra-config` read as the tierkv
backend will read it at SGLang's start-up, offline."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tierkv.cli.common import positive

LAYOUTS = ("page_first", "page_first_direct", "layer_first", "page_head", "page_first_kv_split")
"""SGLang 0.5.23's --hicache-mem-layout values (`tierkv.integrations.sglang.check.LAYOUTS`,
not imported here: the parser stays light)."""


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    sg = sub.add_parser(
        "sglang",
        parents=parents,
        help="tierkv inside SGLang: check a HiCache storage extra config",
        description="tierkv as SGLang HiCache's L3 storage backend.",
    )
    sg_sub = sg.add_subparsers(dest="sglang_command", required=True, metavar="COMMAND")
    sc = sg_sub.add_parser(
        "check",
        parents=parents,
        help="read a --hicache-storage-backend-extra-config as the backend will, offline",
        description="Validate a --hicache-storage-backend-extra-config (the JSON or a file "
        "holding it) and its tier chain against the model's page geometry, as the tierkv "
        "backend will when SGLang starts; print the tiers, the page regions, the namespace "
        "and each call's deadline. Loads the backend class through SGLang's loader where "
        "SGLang is installed. Opens nothing. Exit 2 with the path of the first problem.",
    )
    sc.add_argument("config", help="the JSON (quoted), or @FILE or FILE holding it")
    sc.add_argument("--model", default="MODEL", help="the served model's path or name")
    sc.add_argument("--dtype", default="bfloat16", help="the KV cache dtype (bfloat16)")
    sc.add_argument(
        "--page-size",
        type=positive,
        default=64,
        metavar="N",
        help="tokens per page, SGLang's --page-size (64)",
    )
    sc.add_argument("--layers", type=positive, default=32, metavar="N", help="(32)")
    sc.add_argument(
        "--kv-heads", type=positive, default=8, metavar="N", help="KV heads on one TP rank (8)"
    )
    sc.add_argument(
        "--head-dim",
        type=positive,
        default=128,
        metavar="N",
        help="(128; MLA: kv_lora_rank + qk_rope_head_dim, e.g. 576)",
    )
    sc.add_argument(
        "--layout",
        default="page_first",
        choices=LAYOUTS,  # every one of 0.5.23
        help="SGLang's --hicache-mem-layout (page_first)",
    )
    sc.add_argument("--mla", action="store_true", help="an MLA model (DeepSeek)")
    sc.add_argument("--tp", type=positive, default=1, metavar="N", help="tensor parallel size")
    sc.add_argument("--json", action="store_true", help="print the report as JSON")
    sc.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from tierkv.integrations.sglang.check import Model, check, render

    model = Model(
        name=args.model,
        dtype=args.dtype,
        page_size=args.page_size,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        layout=args.layout,
        mla=args.mla,
        tp=args.tp,
    )
    report = check(args.config, model)
    if args.json:
        print(json.dumps({"model": asdict(model), **asdict(report)}, indent=2))
    else:
        print(render(report, model))
    return 0
