"""The `tierkv` command.

    tierkv demo [--config FILE]        a small transformer's chat workload with and
                                       without tierkv: TTFT, hit rate per tier, checks
    tierkv bench [--config FILE]       each tier's MB/s as a ratio to its raw medium,
                                       and the orchestrator's own cost
    tierkv validate FILE [--connect]   check a YAML chain (and its sizes against this
                                       machine); --connect opens each tier
    tierkv plugins                     installed tier types and their config fields
    tierkv roundtrip [--config FILE]   store -> lookup -> load of random blocks

Without --config, demo and bench run the default chain: the primary plus an nvme
tier in a temporary directory, removed afterwards.

Exit codes: 0 ok, 2 bad usage or config, 1 runtime failure (a tier that cannot be
reached, a failed check). Errors go to stderr as one line (a config error lists its
problems one per line); --verbose adds the traceback and debug logs. When stderr is
not a terminal, demo and bench write plain progress lines there (one per phase, or
every few seconds) instead of a progress bar. JSON output (--json) keeps numbers and
booleans typed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import anyio
from pydantic import ByteSize, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from tierkv import __version__
from tierkv.config import CacheConfig, load_config, parse_config
from tierkv.errors import ConfigError, PluginImportError, TierKVError, UnknownTierType
from tierkv.registry import KNOWN_TIER_PACKAGES, get_tier_class, install_hint, installed_tiers
from tierkv.tier import TierConfig
from tierkv.units import format_size, parse_duration

DEFAULT_SECONDARY: dict[str, Any] = {"type": "nvme", "capacity": "4GiB", "fsync": "never"}
"""The tier of the default chain, under a temporary directory (`path` is added).
fsync is off: the directory is deleted when the command ends."""
FALLBACK_SECONDARY: dict[str, Any] = {"type": "memory", "capacity": "4GiB"}
"""Used instead when tierkv-cache-nvme is not installed."""


class UsageError(Exception):
    """Bad options (exit code 2)."""


# -- helpers ------------------------------------------------------------------------------
def _size(text: str) -> int:
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (use e.g. 1MiB, 256MiB, 4096)"
        ) from None


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} must be at least {minimum}")
        return value

    return parse


_positive = _at_least(1)
_non_negative = _at_least(0)


def _port(text: str) -> int:
    value = _non_negative(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (0-65535)")
    return value


def default_chain(directory: Path, *, primary: str = "8MiB") -> CacheConfig:
    """The primary plus an nvme tier under `directory` (the memory tier when
    tierkv-cache-nvme is not installed). Layout and namespace are placeholders: the demo
    and the bench set their own."""
    secondary = dict(DEFAULT_SECONDARY, path=str(directory / "nvme"))
    try:
        get_tier_class(DEFAULT_SECONDARY["type"])
    except (UnknownTierType, PluginImportError) as exc:
        print(
            f"tierkv: note: {exc.problems[0]}; the default chain uses the memory tier",
            file=sys.stderr,
        )
        secondary = dict(FALLBACK_SECONDARY)
    return parse_config(
        {
            "namespace": "tierkv-default",
            "layout": {"block_bytes": "256KiB", "groups": [{"kind": "full", "block_size": 16}]},
            "primary": {"capacity": primary, "eviction": "lru", "pin_memory": "auto"},
            "tiers": [secondary],
        },
        source="the default chain",
    )


def load_checked(path: str) -> CacheConfig:
    """The chain in `path`, validated and checked against this machine's memory and
    disks (a ConfigError, exit 2, for what could never fit)."""
    from tierkv.machine import machine_problems

    config = load_config(path)
    problems = machine_problems(config)
    if problems:
        raise ConfigError(problems, source=path)
    return config


@contextlib.contextmanager
def _chain(path: str | None, primary: str = "8MiB") -> Iterator[CacheConfig]:
    """The chain in `path`, or the default chain in a temporary directory."""
    if path:
        yield load_checked(path)
        return
    with tempfile.TemporaryDirectory(prefix="tierkv-") as tmp:
        yield default_chain(Path(tmp), primary=primary)


class _Progress:
    """Progress on stderr: a rich bar when stderr is a terminal (and `enabled`), plain
    lines otherwise, so a run in a pipe, a log file or CI still shows it is alive.

    A line is written when the phase (the text before the first `:`) changes, or every
    `every` seconds; each starts with `[tierkv COMMAND   12.3s]`."""

    def __init__(
        self,
        enabled: bool,
        total: int | None,
        description: str,
        *,
        command: str = "",
        every: float = 5.0,
        stream: Any = None,
    ) -> None:
        self._bar: Any = None
        self._task: Any = None
        self._stream = stream if stream is not None else sys.stderr
        self._lines = not self._stream.isatty()
        self._command = command
        self._every = every
        self._started = time.monotonic()
        self._last_line = -float("inf")
        self._last_phase: str | None = None
        self._done = 0
        self._total = total
        if self._lines:
            self._line(description, force=True)
            return
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            return
        columns = [SpinnerColumn(), TextColumn("{task.description}")]
        if total:
            columns += [BarColumn(), MofNCompleteColumn()]
        columns.append(TimeElapsedColumn())
        self._bar = Progress(*columns, console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task(description, total=total)

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def update(self, description: str, advance: int = 0) -> None:
        self._done += advance
        if self._lines:
            self._line(description)
        elif self._bar is not None:
            self._bar.update(self._task, description=description, advance=advance)

    def _line(self, description: str, *, force: bool = False) -> None:
        now = time.monotonic()
        phase = description.split(":", 1)[0]
        if not force and phase == self._last_phase and now - self._last_line < self._every:
            return
        self._last_phase, self._last_line = phase, now
        count = f" ({self._done}/{self._total})" if self._total else ""
        with contextlib.suppress(OSError, ValueError):
            print(
                f"[tierkv {self._command} {now - self._started:6.1f}s] {description}{count}",
                file=self._stream,
                flush=True,
            )


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=_json_value))


def _json_value(value: Any) -> Any:
    """Numbers stay numbers (a ByteSize is an int), enums their value, the rest text."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return str(value)


# -- demo ---------------------------------------------------------------------------------
def _demo_profile(args: argparse.Namespace) -> Any:
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


def _cmd_demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tierkv.demo.report import demo_summary, render
    from tierkv.demo.run import DemoOptions, TurnRecord, run_demo
    from tierkv.demo.workload import WorkloadConfig

    if args.plot:
        from tierkv.demo.plot import check_available

        try:
            check_available()
        except ImportError as exc:
            raise UsageError(str(exc)) from None
    device, profile = _demo_profile(args)
    pm, pw = profile.model, profile.workload
    try:
        options = DemoOptions(
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
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    def show(report: dict[str, Any]) -> None:
        progress.stop()
        if args.plot:
            from tierkv.demo.plot import plot_ttft

            report["plot"] = str(plot_ttft(report, args.plot))
        if args.json:
            _print_json(report)
        else:
            render(demo_summary(report))
            if args.linger > 0 and report.get("metrics_url"):
                print(f"serving metrics for {args.linger:g} s more (Ctrl-C to stop)")
        sys.stdout.flush()

    total = options.workload.users * options.workload.turns
    default_primary = format_size(args.primary or profile.primary_capacity)
    with (
        _chain(args.config, primary=default_primary) as config,
        _Progress(not args.json, total, "warming up", command="demo") as progress,
    ):
        progress.update(
            f"model: {options.model.layers} layers x {options.model.hidden} hidden on {device}"
        )

        def on_turn(record: TurnRecord) -> None:
            served = sum(record.sources.values())
            progress.update(
                f"user {record.user} turn {record.index + 1}: TTFT "
                f"{record.ttft['no_cache'] * 1e3:.0f} / {record.ttft['gpu_prefix_cache'] * 1e3:.0f}"
                f" / {record.ttft['tierkv'] * 1e3:.0f} ms, {served} blocks from tierkv",
                advance=1,
            )

        report = anyio.run(
            lambda: run_demo(
                config,
                options,
                on_turn=on_turn,
                on_report=show,
                metrics_port=args.metrics_port,
                metrics_host=args.metrics_host,
                linger=args.linger,
            )
        )
    if not report["ok"]:
        print("tierkv: error: the runs with and without a cache disagree", file=sys.stderr)
        return 1
    return 0


# -- bench --------------------------------------------------------------------------------
def _cmd_bench(args: argparse.Namespace) -> int:
    if args.gpu:
        from tierkv.gpu.bench import run_gpu_bench

        return run_gpu_bench(args.total, args.repeat, args.json)
    from tierkv.bench import BenchOptions, UnknownMedium, bench_summary, run_bench
    from tierkv.demo.report import render

    try:
        options = BenchOptions(
            block_bytes=args.block_size,
            total_bytes=args.total,
            batch=args.batch,
            concurrency=args.concurrency,
            repeat=args.repeat,
            media=tuple(args.tiers.split(",")) if args.tiers else None,
            orchestrator_keys=args.keys,
            lookup_batch=args.lookup_batch,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with (
        _chain(args.config) as config,
        _Progress(not args.json, None, "starting", command="bench") as progress,
    ):
        try:
            report = anyio.run(lambda: run_bench(config, options, progress=progress.update))
        except UnknownMedium as exc:
            raise UsageError(f"--tiers: {exc}") from None
    if args.json:
        _print_json(report)
    else:
        render(bench_summary(report))
    return 0


# -- validate -----------------------------------------------------------------------------
async def _connect(config: CacheConfig) -> list[dict[str, Any]]:
    """Open each tier on its own, ask it about one key, close it; time both."""
    import os

    from tierkv.jobs import ReqContext
    from tierkv.keys import make_offload_key
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
            entry["error"] = f"{step} failed: {type(exc).__name__}: {_one_line(str(exc))}"
        results.append(entry)
    return results


def _cmd_validate(args: argparse.Namespace) -> int:
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


# -- plugins ------------------------------------------------------------------------------
def _default_text(info: FieldInfo) -> str:
    """A field's default as it would be written in YAML."""
    if info.is_required():
        return "(required)"
    value = info.get_default(call_default_factory=True)
    duration = any(getattr(m, "func", None) is parse_duration for m in info.metadata)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, ByteSize):
        return format_size(int(value))
    if isinstance(value, (int, float)):
        text = f"{value:g}"
        return f"{text}s" if duration else text
    if isinstance(value, Enum):
        return str(value.value)
    return str(value)


def _default_value(info: FieldInfo) -> Any:
    """A field's default as JSON: numbers and booleans typed, sizes in bytes, durations
    in seconds, None for none or required."""
    if info.is_required():
        return None
    value = info.get_default(call_default_factory=True)
    if isinstance(value, Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return int(value) if isinstance(value, ByteSize) else value
    return str(value)


def _unit(info: FieldInfo) -> str | None:
    if any(getattr(m, "func", None) is parse_duration for m in info.metadata):
        return "seconds"
    annotation = info.annotation
    args = getattr(annotation, "__args__", ())
    if annotation is ByteSize or ByteSize in args:
        return "bytes"
    return None


def _fields(model: type[TierConfig], skip: set[str]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "default": _default_value(info),
            "default_text": _default_text(info),
            "unit": _unit(info),
            "required": info.is_required(),
            "description": info.description or "",
        }
        for name, info in model.model_fields.items()
        if name not in skip
    }


def _cmd_plugins(args: argparse.Namespace) -> int:
    from tierkv.demo.report import TextTable, render

    common = set(TierConfig.model_fields)
    report: dict[str, Any] = {
        "common_fields": _fields(TierConfig, {"type"}),
        "types": {},
    }
    broken = []
    for name, info in installed_tiers().items():
        entry: dict[str, Any] = {
            "distribution": info.distribution,
            "version": info.version,
            "target": info.target,
        }
        try:
            entry["fields"] = _fields(get_tier_class(name).Config, common)
        except ConfigError as exc:
            entry["error"] = exc.problems[0]
            broken.append(name)
        report["types"][name] = entry
    if args.json:
        _print_json(report)
        return 1 if broken else 0
    rows = []
    for name, entry in report["types"].items():
        origin = (
            f"{entry['distribution']} {entry['version']}" if entry["distribution"] else "registered"
        )
        rows.append([name, origin, entry["target"]])
    blocks: list[Any] = [
        TextTable(["type", "package", "class"], rows, title="installed tier types", align="lll")
    ]
    missing = [t for t in KNOWN_TIER_PACKAGES if t not in report["types"]]
    if missing:
        blocks.append("not installed: " + ", ".join(f"{t} ({install_hint(t)})" for t in missing))
    for name, entry in report["types"].items():
        blocks.append("")
        if "error" in entry:
            blocks.append(f"{name}: BROKEN: {entry['error']}")
            continue
        if not entry["fields"]:
            blocks.append(f"{name}: no fields of its own")
            continue
        blocks.append(
            TextTable(
                ["field", "default", "description"],
                [[f, d["default_text"], d["description"]] for f, d in entry["fields"].items()],
                title=f"{name}: its own fields",
                align="lll",
            )
        )
    blocks.append("")
    blocks.append(
        TextTable(
            ["field", "default", "description"],
            [[f, d["default_text"], d["description"]] for f, d in report["common_fields"].items()],
            title="every tier also takes",
            align="lll",
        )
    )
    render(blocks)
    return 1 if broken else 0


# -- roundtrip ----------------------------------------------------------------------------
ROUNDTRIP_CHAIN = """
namespace: tierkv-roundtrip
layout: {block_bytes: 256KiB, groups: [{kind: full, block_size: 16}]}
primary: {capacity: 4MiB, eviction: arc, pin_memory: auto}
tiers:
  - {type: memory, capacity: 64MiB}
"""


def _cmd_vllm_check(args: argparse.Namespace) -> int:
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
    )
    report = check(args.config, geometry)
    if args.json:
        print(json.dumps({"geometry": asdict(geometry), **asdict(report)}, indent=2))
    else:
        print(render(report, geometry))
    return 0


def _cmd_roundtrip(args: argparse.Namespace) -> int:
    from tierkv.roundtrip import run_roundtrip

    config = (
        load_checked(args.config)
        if args.config
        else parse_config(ROUNDTRIP_CHAIN, source="built-in chain")
    )
    report = anyio.run(run_roundtrip, config, args.blocks, args.seed)
    if args.json:
        _print_json(report)
    else:
        for line in report["lines"]:
            print(line)
    return 0 if report["ok"] else 1


# -- parser -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        default=argparse.SUPPRESS,
        help="tracebacks and debug logs",
    )
    parser = argparse.ArgumentParser(
        prog="tierkv",
        description="Keeps an LLM server's KV cache alive after it leaves the GPU: a chain "
        "of storage tiers (CPU memory, NVMe, Redis, S3, plugins) with cascade down and "
        "staged promotion up. Exit codes: 0 ok, 2 bad usage or config, 1 runtime failure.",
        parents=[common],
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"tierkv {__version__} (distribution tierkv-cache)",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="a transformer's chat workload: no cache, GPU prefix cache, + tierkv",
        description="Run a multi-turn chat workload on a random-weight transformer three "
        "ways per turn: with no cache, with the engine's own GPU prefix cache (bounded by "
        "its KV blocks), and with that cache plus tierkv. Report time to first token per "
        "column, where reused blocks came from, and whether every run produced the same "
        "tokens (exit 1 if not). On CUDA the defaults are a ~1B-parameter bfloat16 model "
        "and a 4096-token shared prompt, fitted to the GPU's free memory; on the CPU a "
        "4.7M-parameter float32 model. Options given override those defaults.",
    )
    demo.add_argument(
        "--config", metavar="FILE", help="YAML tier chain (default: primary + nvme in a temp dir)"
    )
    demo.add_argument("--json", action="store_true", help="print the report as JSON")
    demo.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw TTFT per turn for the three columns (needs matplotlib)",
    )
    g = demo.add_argument_group("workload (defaults: by device; CPU values shown)")
    g.add_argument("--users", type=_positive, metavar="N", help="conversations (4)")
    g.add_argument("--turns", type=_positive, metavar="N", help="turns per user (4)")
    g.add_argument(
        "--system-tokens", type=_non_negative, metavar="N", help="shared prompt (512; CUDA 4096)"
    )
    g.add_argument(
        "--message-tokens", type=_positive, metavar="N", help="per user turn (96; CUDA 256)"
    )
    g.add_argument(
        "--reply-tokens", type=_positive, metavar="N", help="tokens decoded per turn (16)"
    )
    g = demo.add_argument_group("model and KV cache (defaults: by device; CPU values shown)")
    g.add_argument("--layers", type=_positive, metavar="N", help="4 (CUDA 20)")
    g.add_argument("--hidden", type=_positive, metavar="N", help="256 (CUDA 2048)")
    g.add_argument("--heads", type=_positive, metavar="N", help="4 (CUDA 16)")
    g.add_argument("--vocab", type=_positive, metavar="N", help="4096 (CUDA 32000)")
    g.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], help="float32 (CUDA bfloat16)"
    )
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--seed", type=_non_negative, metavar="N", default=0, help="weights and tokens")
    g.add_argument(
        "--gpu-block-tokens", type=_positive, metavar="N", default=16, help="KV block (16)"
    )
    g.add_argument(
        "--block-factor",
        type=_positive,
        metavar="N",
        default=2,
        help="KV blocks per offloaded block (2)",
    )
    g.add_argument(
        "--gpu-blocks",
        type=_positive,
        metavar="N",
        default=None,
        help="KV cache blocks per engine (default: the longest request)",
    )
    g.add_argument(
        "--primary",
        type=_size,
        metavar="SIZE",
        default=None,
        help="primary capacity (default chain: 8MiB, CUDA 1GiB; overrides the config's)",
    )
    g.add_argument(
        "--atol", type=float, metavar="X", default=None, help="logit tolerance (by dtype)"
    )
    g = demo.add_argument_group("metrics")
    g.add_argument(
        "--metrics-port",
        type=_port,
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
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="each tier's speed as a ratio to its raw medium",
        description="Store then load blocks through each medium of a chain and through "
        "the medium's plain client in the same run; report MB/s, the ratio and latency; "
        "then the orchestrator's bookkeeping rate over many resident keys.",
    )
    bench.add_argument(
        "--config", metavar="FILE", help="YAML tier chain (default: primary + nvme in a temp dir)"
    )
    bench.add_argument(
        "--block-size", type=_size, metavar="SIZE", default=1 << 20, help="default 1MiB"
    )
    bench.add_argument(
        "--total", type=_size, metavar="SIZE", default=256 << 20, help="per medium (256MiB)"
    )
    bench.add_argument(
        "--batch", type=_positive, metavar="N", default=8, help="blocks per call (8)"
    )
    bench.add_argument(
        "--concurrency", type=_positive, metavar="N", default=8, help="calls in flight (8)"
    )
    bench.add_argument("--repeat", type=_positive, metavar="N", default=3, help="repetitions (3)")
    bench.add_argument(
        "--tiers", metavar="NAMES", help="comma-separated media to measure (cpu,nvme,...)"
    )
    bench.add_argument(
        "--keys",
        type=_non_negative,
        metavar="N",
        default=1_000_000,
        help="resident keys for the orchestrator measurement (0 skips it)",
    )
    bench.add_argument(
        "--lookup-batch", type=_positive, metavar="N", default=128, help="keys per call"
    )
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument(
        "--gpu", action="store_true", help="the GPU hop per copy backend (tierkv.gpu.bench)"
    )
    bench.set_defaults(func=_cmd_bench)

    va = sub.add_parser(
        "validate",
        parents=[common],
        help="validate a YAML tier chain",
        description="Check a YAML tier chain: UTF-8, no repeated keys, every field of "
        "every tier, unique tier names and paths, and sizes this machine can hold (the "
        "primary against its memory, each disk tier against its filesystem). Exit 2 "
        "with one line per problem, by YAML path; secrets are never shown.",
    )
    va.add_argument("file", help="the YAML file")
    va.add_argument("--connect", action="store_true", help="also open each tier and time a lookup")
    va.set_defaults(func=_cmd_validate)

    pl = sub.add_parser(
        "plugins",
        parents=[common],
        help="installed tier types and their config fields",
        description="List the tier types installed (entry points of the tierkv.tiers group "
        "and registered classes): the package and version that provides each, its class, "
        "its own config fields with defaults, and the fields every tier takes. Exit 1 "
        "if a plugin fails to import.",
    )
    pl.add_argument(
        "--json", action="store_true", help="print as JSON (defaults typed: bytes, seconds)"
    )
    pl.set_defaults(func=_cmd_plugins)

    rt = sub.add_parser(
        "roundtrip",
        parents=[common],
        help="store -> lookup -> load of random blocks",
        description="Store random blocks through a chain, flush, look them up and load "
        "them back, and check every byte: a quick end-to-end test of a chain. Exit 1 if "
        "a block is missing or differs.",
    )
    rt.add_argument(
        "--config", metavar="FILE", help="YAML tier chain (default: primary + memory tier)"
    )
    rt.add_argument(
        "--blocks", type=_positive, metavar="N", default=64, help="blocks to store (default 64)"
    )
    rt.add_argument("--seed", type=int, default=0, help="seed for the block contents")
    rt.add_argument("--json", action="store_true", help="machine-readable report")
    rt.set_defaults(func=_cmd_roundtrip)

    vl = sub.add_parser(
        "vllm",
        parents=[common],
        help="tierkv inside vLLM: check a --kv-transfer-config",
        description="tierkv as vLLM's KV-offloading secondary tiers.",
    )
    vl_sub = vl.add_subparsers(dest="vllm_command", required=True, metavar="COMMAND")
    vc = vl_sub.add_parser(
        "check",
        parents=[common],
        help="read a --kv-transfer-config as vLLM will, offline",
        description="Parse a --kv-transfer-config with vLLM's own parser and factories, "
        "resolve every tierkv entry as the adapter will at start-up, and print the tier "
        "chain with each tier's medium, sizes and namespace. Opens nothing. Exit 2 with "
        "the path of the first problem. Run it where vLLM is installed.",
    )
    vc.add_argument("config", help="the JSON (quoted) or a file holding it")
    vc.add_argument("--model", default="MODEL", help="the served model's name (namespace)")
    vc.add_argument("--dtype", default="bfloat16", help="the KV cache dtype (bfloat16)")
    vc.add_argument("--tokens-per-block", type=_positive, default=16, metavar="N", help="(16)")
    vc.add_argument("--blocks-per-chunk", type=_positive, default=1, metavar="N", help="(1)")
    vc.add_argument(
        "--row-bytes",
        type=_size,
        default=2 << 20,
        metavar="SIZE",
        help="bytes of one offloaded chunk on one worker x TP (2MiB)",
    )
    vc.add_argument("--tp", type=_positive, default=1, metavar="N", help="tensor parallel size")
    vc.add_argument(
        "--parallelism-agnostic",
        action="store_true",
        help="the engine's layout is parallelism-agnostic (namespace without topology)",
    )
    vc.add_argument("--json", action="store_true", help="print the report as JSON")
    vc.set_defaults(func=_cmd_vllm_check)
    return parser


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real error inside an exception group (a task group's failure)."""
    inner = getattr(exc, "exceptions", None)
    while isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    return exc


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _closed_pipe() -> int:
    """The reader of stdout went away (`tierkv plugins --json | head -1`): stop quietly,
    as a Unix tool killed by SIGPIPE does (exit 141), and point stdout at /dev/null so
    the interpreter's last flush does not complain."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 141


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        code = func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _closed_pipe()
    except KeyboardInterrupt:
        print("tierkv: interrupted", file=sys.stderr)
        return 130
    except Exception as raised:
        if verbose:
            traceback.print_exc()
        error = _first_leaf(raised)
        if isinstance(error, BrokenPipeError):
            return _closed_pipe()
        if isinstance(error, KeyboardInterrupt):
            print("tierkv: interrupted", file=sys.stderr)
            return 130
        if isinstance(error, ConfigError):
            print(f"tierkv: {error}", file=sys.stderr)
            return 2
        if isinstance(error, UsageError):
            print(f"tierkv {args.command}: error: {error}", file=sys.stderr)
            return 2
        kind = "" if isinstance(error, TierKVError) else f"{type(error).__name__}: "
        hint = "" if verbose else " (--verbose for the traceback)"
        print(f"tierkv: error: {kind}{_one_line(str(error))}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
