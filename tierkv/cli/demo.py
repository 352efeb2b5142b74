"""`tierkv demo`: a transformer's chat workload with no cache, the GPU prefix cache,
and the GPU prefix cache + tierkv.

The tiers of the chain keep their files in a fresh temporary directory, removed when
the demo ends (Ctrl-C, SIGTERM and errors included), so two runs in a row start from
the same empty chain; `--keep` uses the chain's own paths, and the report then says
how many blocks an earlier run left there. `--plot` without a file name writes into
the system's temporary directory, never into the current one."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import anyio

from tierkv.cli.common import (
    UsageError,
    chain,
    check_machine,
    load_checked,
    non_negative,
    port,
    positive,
    print_json,
    size,
)
from tierkv.cli.progress import Progress

if TYPE_CHECKING:
    from tierkv.config import CacheConfig
    from tierkv.demo.records import TurnRecord


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        parents=parents,
        help="a transformer's chat workload: no cache, GPU prefix cache, + tierkv",
        description="Run a multi-turn chat workload on a random-weight transformer three "
        "ways per turn: with no cache, with the engine's own GPU prefix cache (bounded by "
        "its KV blocks), and with that cache plus tierkv. Report time to first token per "
        "column, where reused blocks came from, and whether every run produced the same "
        "tokens (exit 1 if not). On CUDA the defaults are a ~1B-parameter bfloat16 model "
        "and a 4096-token shared prompt, fitted to the GPU's free memory; on the CPU a "
        "4.7M-parameter float32 model. Options given override those defaults. The tiers "
        "keep their files (an nvme directory, a database file) in a fresh temporary "
        "directory, removed when the demo ends, so every run starts empty; --keep uses "
        "the paths of the --config file instead.",
    )
    demo.add_argument(
        "--config", metavar="FILE", help="YAML tier chain (default: primary + nvme in a temp dir)"
    )
    demo.add_argument(
        "--keep",
        action="store_true",
        help="with --config: use (and keep) the tiers' own paths; blocks an earlier run "
        "left there are reused, and the report says how many",
    )
    demo.add_argument("--json", action="store_true", help="print the report as JSON")
    demo.add_argument(
        "--plot",
        metavar="FILE.png",
        nargs="?",
        const="",
        help="also draw TTFT per turn for the three columns (needs matplotlib); without "
        "FILE, a new tierkv-demo-ttft-*.png in the temporary directory; the path is printed",
    )
    _workload_arguments(demo)
    _hybrid_arguments(demo)
    _model_arguments(demo)
    _metrics_arguments(demo)
    demo.set_defaults(func=run)


def _workload_arguments(demo: argparse.ArgumentParser) -> None:
    """The chat: how many users and turns, and the tokens of each prompt part and reply."""
    g = demo.add_argument_group("workload (defaults: by device; CPU values shown)")
    g.add_argument("--users", type=positive, metavar="N", help="conversations (4)")
    g.add_argument("--turns", type=positive, metavar="N", help="turns per user (4)")
    g.add_argument(
        "--system-tokens", type=non_negative, metavar="N", help="shared prompt (512; CUDA 4096)"
    )
    g.add_argument(
        "--message-tokens", type=positive, metavar="N", help="per user turn (96; CUDA 256)"
    )
    g.add_argument(
        "--reply-tokens", type=positive, metavar="N", help="tokens decoded per turn (16)"
    )


def _hybrid_arguments(demo: argparse.ArgumentParser) -> None:
    """A hybrid model's other layer kind, its window, and where stored hits may land."""
    g = demo.add_argument_group("hybrid models")
    g.add_argument(
        "--hybrid",
        choices=["window", "state"],
        default=None,
        help="alternate full-attention layers with sliding-window attention layers "
        "(window) or gated linear-recurrence layers (state); each kind is its own KV "
        "group with its own block table and keys, and the summary shows bytes moved per group",
    )
    g.add_argument(
        "--window",
        type=positive,
        metavar="TOKENS",
        default=None,
        help="with --hybrid window: the sliding window (default: 3 offloaded blocks)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=positive,
        metavar="TOKENS",
        default=None,
        help="with --hybrid: hits of stored requests land on multiples of TOKENS (and on "
        "each request's end), so stores keep only the window blocks and states those "
        "hits need (layout.checkpoint_every; default: every block boundary)",
    )


def _model_arguments(demo: argparse.ArgumentParser) -> None:
    """The model's shape and dtype, the device, and the engines' KV cache and primary."""
    g = demo.add_argument_group("model and KV cache (defaults: by device; CPU values shown)")
    g.add_argument("--layers", type=positive, metavar="N", help="4 (CUDA 20)")
    g.add_argument("--hidden", type=positive, metavar="N", help="256 (CUDA 2048)")
    g.add_argument("--heads", type=positive, metavar="N", help="4 (CUDA 16)")
    g.add_argument("--vocab", type=positive, metavar="N", help="4096 (CUDA 32000)")
    g.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], help="float32 (CUDA bfloat16)"
    )
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--seed", type=non_negative, metavar="N", default=0, help="weights and tokens")
    g.add_argument(
        "--gpu-block-tokens", type=positive, metavar="N", default=16, help="KV block (16)"
    )
    g.add_argument(
        "--block-factor",
        type=positive,
        metavar="N",
        default=2,
        help="KV blocks per offloaded block (2)",
    )
    g.add_argument(
        "--gpu-blocks",
        type=positive,
        metavar="N",
        default=None,
        help="KV cache blocks per engine (default: the longest request)",
    )
    g.add_argument(
        "--primary",
        type=size,
        metavar="SIZE",
        default=None,
        help="primary capacity (default chain: 8MiB, CUDA 1GiB; overrides the config's)",
    )
    g.add_argument(
        "--atol", type=float, metavar="X", default=None, help="logit tolerance (by dtype)"
    )


def _metrics_arguments(demo: argparse.ArgumentParser) -> None:
    """The Prometheus endpoint, and how long it stays up after the run."""
    g = demo.add_argument_group("metrics")
    g.add_argument(
        "--metrics-port",
        type=port,
        metavar="PORT",
        default=None,
        help="serve Prometheus metrics on this port",
    )
    g.add_argument("--metrics-host", metavar="HOST", default="127.0.0.1", help="default 127.0.0.1")
    g.add_argument(
        "--linger",
        type=float,
        metavar="SECONDS",
        default=0.0,
        help="keep serving metrics this long after the run",
    )


# -- where the tiers keep their files ------------------------------------------------------
@contextlib.contextmanager
def demo_chain(
    path: str | None, *, keep: bool, primary: str
) -> Iterator[tuple[CacheConfig, dict[str, Any]]]:
    """The chain the demo runs on, and where its tiers keep their files (for the
    report): the file's tiers moved into a fresh temporary directory, removed on the
    way out; with `keep`, the file's own paths; without a file, the default chain (in
    a temporary directory too)."""
    from tierkv.demo.scratch import in_scratch, tier_paths

    if not path:
        if keep:
            raise UsageError("--keep needs --config FILE (the default chain lives in a temp dir)")
        with chain(None, primary=primary) as config:
            yield config, {"temporary": True, "paths": tier_paths(config)}
        return
    if keep:
        config = load_checked(path)
        yield config, {"temporary": False, "paths": tier_paths(config)}
        return
    from tierkv.config import load_config

    config = load_config(path)
    with tempfile.TemporaryDirectory(prefix="tierkv-demo-") as tmp:
        config = in_scratch(config, Path(tmp))
        check_machine(config, path)  # the sizes where the files will really be
        yield config, {"temporary": True, "paths": tier_paths(config)}


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (`kill`, `timeout`) ends the demo as Ctrl-C does: the cache closes and
    the temporary directory is removed on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


# -- the command ----------------------------------------------------------------------------
def _profile(args: argparse.Namespace) -> Any:
    """The device's defaults (a ~1B bfloat16 model on CUDA, a small one on the CPU),
    with every option given on the command line taking precedence."""
    import torch

    from tierkv.demo.sizing import cuda_free_bytes, profile_for

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available (use auto or cpu)")
    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    free = cuda_free_bytes() if device == "cuda" else None
    return device, profile_for(device, free_bytes=free, block_tokens=args.gpu_block_tokens)


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _options(args: argparse.Namespace, device: str, profile: Any) -> Any:
    from dataclasses import replace

    from tierkv.demo.hybrid_model import HybridConfig
    from tierkv.demo.records import DemoOptions
    from tierkv.demo.workload import WorkloadConfig

    pm, pw = profile.model, profile.workload
    if args.window is not None and args.hybrid != "window":
        raise UsageError("--window needs --hybrid window")
    if args.checkpoint_every is not None:
        step = args.gpu_block_tokens * args.block_factor  # tokens per offloaded block
        if args.hybrid is None:
            raise UsageError("--checkpoint-every needs --hybrid window or --hybrid state")
        if args.checkpoint_every % step:
            near = max(step, args.checkpoint_every // step * step)
            raise UsageError(
                f"--checkpoint-every {args.checkpoint_every} is not a multiple of the "
                f"offloaded block ({step} tokens); use e.g. {near}"
            )
    try:
        hybrid = None
        if args.hybrid is not None:
            window = args.window or 3 * args.gpu_block_tokens * args.block_factor
            hybrid = HybridConfig(
                args.hybrid,
                window if args.hybrid == "window" else None,
                checkpoint_every=args.checkpoint_every,
            )
        return DemoOptions(
            model=replace(
                pm,
                vocab=_pick(args.vocab, pm.vocab),
                hidden=_pick(args.hidden, pm.hidden),
                layers=_pick(args.layers, pm.layers),
                heads=_pick(args.heads, pm.heads),
                seed=args.seed,
                dtype=_pick(args.dtype, pm.dtype),
            ),
            workload=WorkloadConfig(
                users=_pick(args.users, pw.users),
                turns=_pick(args.turns, pw.turns),
                system_tokens=_pick(args.system_tokens, pw.system_tokens),
                message_tokens=_pick(args.message_tokens, pw.message_tokens),
                reply_tokens=_pick(args.reply_tokens, pw.reply_tokens),
                seed=args.seed,
            ),
            device=device,
            gpu_block_tokens=args.gpu_block_tokens,
            block_factor=args.block_factor,
            gpu_blocks=args.gpu_blocks,
            primary_capacity=args.primary,
            atol=args.atol,
            hybrid=hybrid,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from tierkv.demo.run import run_demo

    if args.plot is not None:
        from tierkv.demo.plot import check_available

        try:
            check_available()
        except ImportError as exc:
            raise UsageError(str(exc)) from None
    device, profile = _profile(args)
    options = _options(args, device, profile)
    total = options.workload.users * options.workload.turns
    from tierkv.contract.units import format_size

    default_primary = format_size(args.primary or profile.primary_capacity)
    with (
        sigterm_as_interrupt(),
        demo_chain(args.config, keep=args.keep, primary=default_primary) as (config, where),
        Progress(not args.json, total, "warming up", command="demo") as progress,
    ):
        progress.update(
            f"model: {options.model.layers} layers x {options.model.hidden} hidden on {device}"
        )
        report = anyio.run(
            lambda: run_demo(
                config,
                options,
                on_turn=partial(_show_turn, progress),
                on_report=partial(_show_report, args, progress, dict(where)),
                metrics_port=args.metrics_port,
                metrics_host=args.metrics_host,
                linger=args.linger,
            )
        )
    if not report["ok"]:
        print("tierkv: error: the runs with and without a cache disagree", file=sys.stderr)
        return 1
    return 0


def _show_turn(progress: Progress, record: TurnRecord) -> None:
    """A finished turn on the progress line: its TTFT per column, and the blocks
    tierkv served."""
    served = sum(record.sources.values())
    progress.update(
        f"user {record.user} turn {record.index + 1}: TTFT "
        f"{record.ttft['no_cache'] * 1e3:.0f} / {record.ttft['gpu_prefix_cache'] * 1e3:.0f}"
        f" / {record.ttft['tierkv'] * 1e3:.0f} ms, {served} blocks from tierkv",
        advance=1,
    )


def _show_report(
    args: argparse.Namespace, progress: Progress, files: dict[str, Any], report: dict[str, Any]
) -> None:
    """The report, printed while the cache (and the metrics endpoint) is still up:
    with where the tiers kept their `files` and the plot, if asked for, as JSON or as
    the summary."""
    from tierkv.demo.report import demo_summary, render

    progress.stop()
    report["tier_files"] = files
    if args.plot is not None:
        from tierkv.demo.plot import plot_path, plot_ttft

        report["plot"] = str(plot_ttft(report, plot_path(args.plot)))
    if args.json:
        print_json(report)
    else:
        render(demo_summary(report))
        if args.linger > 0 and report.get("metrics_url"):
            print(f"serving metrics for {args.linger:g} s more (Ctrl-C to stop)")
    sys.stdout.flush()
