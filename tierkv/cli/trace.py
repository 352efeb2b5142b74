"""`tierkv bench trace FILE`: replay a request trace through real tiers, once per tier
capacity and admission policy (`tierkv.trace`); `--capacity-sweep` for one table over
many sizes, `--tenant-report T` for what the other tenants cost tenant T."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast, get_args

import anyio

from tierkv.cli.common import UsageError, block_size, positive, print_json, size
from tierkv.cli.progress import Progress

if TYPE_CHECKING:
    from tierkv.cache.prefetch import PrefetchPolicy
    from tierkv.trace import CostModel
    from tierkv.trace.bench import TraceBenchOptions


def _floats(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 1)")
    return value


def _bandwidth(text: str) -> dict[str, float]:
    """`nvme=3GiB,redis=1GiB`: bytes per second per medium."""
    out: dict[str, float] = {}
    for part in text.split(","):
        medium, _, rate = part.partition("=")
        if not medium or not rate:
            raise argparse.ArgumentTypeError(
                f"{part!r}: write MEDIUM=BYTES_PER_SECOND, e.g. nvme=3GiB"
            )
        out[medium.strip()] = float(size(rate.strip()))
    return out


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "trace",
        parents=parents,
        help="replay a request trace through real tiers",
        description="Replay a Mooncake-format JSONL trace (timestamp ms, input_length, "
        "output_length, hash_ids of 512-token blocks) through a real TieredCache, once per "
        "tier capacity and admission policy. Reports the prefix hit rate beside an "
        "infinite cache and a plain LRU of the same capacity, hits and bytes per tier, "
        "evictions, and a TTFT estimate from a stated cost model (one prefill at a time); "
        "under a backlog, a queued replay per prefetch policy drives cache.prefetch for "
        "the next queued requests and reports TTFT with and without it.",
    )
    _replay_arguments(p)
    p.add_argument(
        "--capacity-sweep", action="store_true",
        help="replay once per primary size x tier capacity x admission policy and print "
        "one table of served share, served / a same-size LRU and blocks written (no "
        "backlog, no TTFT)",
    )  # fmt: skip
    p.add_argument(
        "--tenant-report", metavar="TENANT",
        help="replay TENANT's requests alone, then the whole trace, through the same chain "
        "(sizes: of TENANT's distinct blocks) and print TENANT's served share in each and "
        "their ratio (no backlog, no TTFT)",
    )  # fmt: skip
    p.add_argument(
        "--quotas", type=Path, metavar="FILE",
        help="a YAML file holding the cache's tenants.quotas mapping (e.g. {primary: "
        "{tenants: {A: 50%%}}, nvme: {tenants: {A: 50%%}}}), set in every replayed chain",
    )  # fmt: skip
    _backlog_arguments(p)
    _cost_model_arguments(p)
    p.add_argument("--plot", metavar="FILE.png", help="hit rate and bytes written vs capacity")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    """What is replayed (the trace, how much of it) and through what: the block size,
    the primary, the tiers and their capacities, the admission policies."""
    p.add_argument("file", type=Path, help="the trace (JSONL)")
    p.add_argument("--requests", type=positive, metavar="N", help="replay only the first N")
    p.add_argument(
        "--block-bytes", type=block_size, metavar="SIZE",
        help="tierkv block per trace block (64KiB, the cost model scales to the model's "
        "size; 4KiB with --capacity-sweep or --tenant-report)",
    )  # fmt: skip
    p.add_argument(
        "--primary", metavar="N|P%",
        help="primary: blocks or %% of distinct (2%%; with --capacity-sweep a list, 0.5%%,2%%)",
    )  # fmt: skip
    p.add_argument(
        "--tier-capacity", metavar="LIST",
        help="each tier's capacity, blocks or %% of distinct; one replay each (10%%,25%%; "
        "with --capacity-sweep 5%%,12%%,20%%,27%%,40%%,50%%; with --tenant-report 25%% of "
        "the tenant's distinct)",
    )  # fmt: skip
    p.add_argument(
        "--tiers", metavar="LIST",
        help="nvme, memory, redis (nvme; memory with --capacity-sweep: the same LRU and "
        "admission, about 10x faster on a small disk)",
    )  # fmt: skip
    p.add_argument(
        "--admission", metavar="LIST",
        help="policies to compare (all,reuse,tinylfu; all with --tenant-report; also "
        "adaptive)",
    )  # fmt: skip
    p.add_argument("--redis-url", metavar="URL", help="for a redis tier")
    p.add_argument("--dir", type=Path, metavar="DIR", help="where nvme writes (a temp dir)")


def _backlog_arguments(p: argparse.ArgumentParser) -> None:
    """How busy the modelled server is, and the backlog's queued replays: the
    prefetch policies, how far ahead they look, and clients that give up."""
    p.add_argument(
        "--load", type=_floats, default=0.7, metavar="X",
        help="arrivals scaled so no-cache prefill keeps the server this busy (0.7)",
    )  # fmt: skip
    p.add_argument(
        "--backlog-load", type=_floats, default=1.3, metavar="X",
        help="the same, for the backlog case: replayed through a modelled server that "
        "prefetches for queued requests (1.3)",
    )  # fmt: skip
    p.add_argument(
        "--prefetch", default="best_effort", metavar="LIST",
        help="prefetch policies to replay under the backlog, each against no prefetch: "
        "best_effort, wait; none: skip the queued replays (best_effort)",
    )  # fmt: skip
    p.add_argument(
        "--prefetch-depth", type=positive, default=8, metavar="N",
        help="prefetch for the next N queued requests (8)",
    )  # fmt: skip
    p.add_argument(
        "--prefetch-timeout", type=_floats, default=60.0, metavar="S",
        help="the wait policy's timeout, real seconds; a prefetch ends at its request's "
        "turn anyway (60)",
    )  # fmt: skip
    p.add_argument(
        "--abandon", type=_share, default=0.0, metavar="P",
        help="share of requests whose clients give up while queued (dropped at their "
        "turn, their prefetch cancelled; the same requests in every run) (0)",
    )  # fmt: skip


def _cost_model_arguments(p: argparse.ArgumentParser) -> None:
    """The cost model's figures that turn the replay's blocks and bytes into TTFT."""
    p.add_argument(
        "--prefill-tps", type=_floats, metavar="N",
        help="prefill tokens/s of the model (12000, assumed: Llama-3.1-8B bf16, one H100)",
    )  # fmt: skip
    p.add_argument(
        "--kv-bytes-per-token", type=size, metavar="SIZE", help="KV bytes per token (128KiB)"
    )
    p.add_argument(
        "--bandwidth", type=_bandwidth, metavar="M=RATE,...",
        help="bytes/s per medium for the cost model, e.g. nvme=3GiB,cpu=25GiB "
        "(default: the primary 25 GB/s, tiers as measured by the replay)",
    )  # fmt: skip


ADMISSIONS = "all,reuse,tinylfu"
"""`--admission`'s policies by default (with `--tenant-report`: `all`)."""


def run(args: argparse.Namespace) -> int:
    if args.tenant_report is not None:
        return _run_tenant_report(args)
    if args.capacity_sweep:
        return _run_sweep(args)
    from tierkv.trace import TraceError
    from tierkv.trace.bench import run_trace_bench, summary_lines

    model = _cost_model(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib: pip install matplotlib (the `plot` extra)"
            ) from None
    options = _options(args, model, _prefetch_policies(args.prefetch))
    with Progress(not args.json, None, "reading the trace", command="bench") as progress:
        try:
            report = anyio.run(lambda: run_trace_bench(options, progress.update))
        except TraceError as exc:
            raise UsageError(str(exc)) from None
        except ValueError as exc:  # capacities, tiers, quotas (ConfigError)
            raise UsageError(_quota_hint(str(exc), args.quotas)) from None
    if args.json:
        print_json(report)
    else:
        print("\n".join(summary_lines(report)))
    if args.plot:
        from tierkv.trace.plot import plot_trace

        where = plot_trace(report, args.plot).resolve()
        print(f"plot: {where}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _run_sweep(args: argparse.Namespace) -> int:
    """`--capacity-sweep`: every size is checked before the trace is read, then one
    replay per primary x tier capacity x policy, printed as one table."""
    from tierkv.trace.sweep import (
        SWEEP_CAPACITIES,
        SWEEP_PRIMARIES,
        SweepOptions,
        check_size,
        run_capacity_sweep,
        sweep_lines,
    )

    if args.plot:
        raise UsageError("--plot draws the plain replay's runs; drop it with --capacity-sweep")
    sizes = {}
    for flag, text, default in (
        ("--primary", args.primary, SWEEP_PRIMARIES),
        ("--tier-capacity", args.tier_capacity, SWEEP_CAPACITIES),
    ):
        try:
            sizes[flag] = tuple(check_size(t) for t in _split(text)) if text else default
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    options = SweepOptions(
        args.file,
        limit=args.requests,
        block_bytes=args.block_bytes or 4 << 10,
        primaries=sizes["--primary"],
        capacities=sizes["--tier-capacity"],
        tiers=_split(args.tiers or "memory"),
        admissions=_admissions(args.admission or ADMISSIONS),
        directory=args.dir,
        redis_url=args.redis_url,
        quotas=_quotas(args.quotas),
    )
    with Progress(not args.json, None, "reading the trace", command="bench") as progress:
        try:
            report = anyio.run(lambda: run_capacity_sweep(options, progress.update))
        except ValueError as exc:  # the trace (TraceError), tiers, quotas (ConfigError)
            raise UsageError(_quota_hint(str(exc), args.quotas)) from None
    if args.json:
        print_json(report)
    else:
        print("\n".join(sweep_lines(report)))
    return 0


def _run_tenant_report(args: argparse.Namespace) -> int:
    """`--tenant-report T`: per tier capacity x policy, T's requests replayed alone and
    then the whole trace, through fresh chains of the same sizes and quotas."""
    from tierkv.trace.sweep import check_size
    from tierkv.trace.tenants import TenantReportOptions, run_tenant_report, tenant_lines

    if args.capacity_sweep or args.plot:
        flag = "--capacity-sweep" if args.capacity_sweep else "--plot"
        raise UsageError(f"--tenant-report is a report of its own; drop {flag}")
    if not args.tenant_report.strip():
        raise UsageError('--tenant-report: name a tenant (as the trace\'s "tenant" field)')
    try:
        primary = check_size(args.primary or "2%")
        capacities = tuple(check_size(t) for t in _split(args.tier_capacity or "25%"))
    except ValueError as exc:
        raise UsageError(f"--primary / --tier-capacity: {exc}") from None
    options = TenantReportOptions(
        args.file,
        args.tenant_report,
        limit=args.requests,
        block_bytes=args.block_bytes or 4 << 10,
        primary=primary,
        capacities=capacities,
        tiers=_split(args.tiers or "nvme"),
        admissions=_admissions(args.admission or "all"),
        directory=args.dir,
        redis_url=args.redis_url,
        quotas=_quotas(args.quotas),
    )
    with Progress(not args.json, None, "reading the trace", command="bench") as progress:
        try:
            report = anyio.run(lambda: run_tenant_report(options, progress.update))
        except ValueError as exc:  # the trace (TraceError), tiers, quotas (ConfigError)
            raise UsageError(_quota_hint(str(exc), args.quotas)) from None
    if args.json:
        print_json(report)
    else:
        print("\n".join(tenant_lines(report)))
    return 0


def _quotas(path: Path | None) -> dict[str, Any] | None:
    """`--quotas FILE`: the YAML mapping that becomes the replayed chains'
    `tenants.quotas` (read strictly: UTF-8, no repeated key); None without the option.
    Its content is checked with the chain's config, as the cache's YAML is."""
    if path is None:
        return None
    from tierkv.config.reading import decode_utf8, read_yaml

    try:
        data = read_yaml(decode_utf8(path.read_bytes(), str(path)), str(path))
    except OSError as exc:
        raise UsageError(f"--quotas {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # ConfigError: not UTF-8, malformed YAML, repeated keys
        raise UsageError(f"--quotas {path}: {exc}") from None
    example = "write e.g. {primary: {tenants: {A: 50%}}, nvme: {tenants: {A: 50%}}}"
    if not isinstance(data, dict):
        got = "nothing" if data is None else f"a {type(data).__name__}"
        raise UsageError(
            f"--quotas {path}: expected the tenants.quotas mapping, got {got}; {example}"
        )
    if set(data) & {"quotas", "tenants"}:
        raise UsageError(
            f"--quotas {path}: the file holds the tenants.quotas mapping itself, tier name "
            f"-> its quotas, without a `tenants:` or `quotas:` key above it; {example}"
        )
    return data


def _quota_hint(message: str, path: Path | None) -> str:
    """A config error's message, saying where `tenants.quotas` came from."""
    if path is not None and "tenants.quotas" in message:
        return f"{message}\n(tenants.quotas is the content of --quotas {path})"
    return message


def _split(text: str) -> tuple[str, ...]:
    """A comma-separated option's items, blanks dropped."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _admissions(text: str) -> tuple[str, ...]:
    """`--admission`: the policies to compare (the tier's `admission` values)."""
    from tierkv.contract.tier import Admission

    policies = _split(text)
    bad = [a for a in policies if a not in get_args(Admission)]
    if bad or not policies:
        raise UsageError(
            f"--admission: {', '.join(bad) or 'empty'} (use {', '.join(get_args(Admission))})"
        )
    return policies


def _cost_model(args: argparse.Namespace) -> CostModel:
    """The stated cost model, with the prefill rate and KV size given on the command line."""
    from dataclasses import replace

    from tierkv.trace import CostModel

    model = CostModel()
    if args.prefill_tps:
        model = replace(model, prefill_tokens_per_s=args.prefill_tps)
    if args.kv_bytes_per_token:
        model = replace(model, kv_bytes_per_token=args.kv_bytes_per_token)
    return model


def _prefetch_policies(text: str) -> tuple[PrefetchPolicy, ...]:
    """`--prefetch`: the policies to replay under the backlog, each once, in the
    order given; `none`: no queued replay."""
    policies = [p.strip() for p in text.split(",") if p.strip()]
    if policies == ["none"]:
        return ()
    wrong = [p for p in policies if p not in ("best_effort", "wait")]
    if wrong or not policies:
        raise UsageError(
            f"--prefetch: {', '.join(wrong) or 'empty'} (use best_effort, wait, or none)"
        )
    return tuple(cast("PrefetchPolicy", p) for p in dict.fromkeys(policies))


def _options(
    args: argparse.Namespace, model: CostModel, prefetch: tuple[PrefetchPolicy, ...]
) -> TraceBenchOptions:
    """The bench's options from the command line's (lists split at commas)."""
    from tierkv.trace.bench import TraceBenchOptions

    return TraceBenchOptions(
        args.file,
        limit=args.requests,
        block_bytes=args.block_bytes or 64 << 10,
        primary=args.primary or "2%",
        tier_capacities=tuple(c.strip() for c in (args.tier_capacity or "10%,25%").split(",")),
        tiers=tuple(t.strip() for t in (args.tiers or "nvme").split(",")),
        admissions=_admissions(args.admission or ADMISSIONS),
        redis_url=args.redis_url,
        directory=args.dir,
        load=args.load,
        backlog_load=args.backlog_load,
        model=model,
        bandwidth=args.bandwidth or {},
        prefetch=prefetch,
        prefetch_depth=args.prefetch_depth,
        prefetch_timeout=args.prefetch_timeout,
        abandon=args.abandon,
        quotas=_quotas(args.quotas),
    )
