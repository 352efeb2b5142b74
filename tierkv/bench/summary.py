"""The bench's report for the terminal: the media table, the orchestrator's
bookkeeping, the streaming phase and the integrity section. Measurements and their
ratios to the raw medium only: the project's own bounds (`targets.py`) are for its
developers (`check_targets` on a `--json` report), not a user's pass or fail."""

from __future__ import annotations

from typing import Any

from tierkv.bench.integrity import integrity_summary
from tierkv.contract.units import format_size
from tierkv.demo.report import Block, TextTable


def bench_summary(report: dict[str, Any]) -> list[Block]:
    """Lines and tables for the terminal: the media, then each optional section the
    report holds (orchestrator, streaming, bookkeeping, integrity)."""
    orch = report.get("orchestrator")
    stream = report.get("streaming")
    blocks: list[Block] = [_header(report), "", *_media(report["media"])]
    if orch:
        blocks += ["", _orchestrator_table(orch)]
    if stream:
        blocks += ["", *_streaming(stream)]
    if orch and "load_1024_us_per_block" in orch:
        blocks.append(_bookkeeping_line(orch))
    if orch and orch.get("admission_us_per_block"):
        blocks.append(_admission_line(orch["admission_us_per_block"]))
    if report.get("integrity"):
        blocks += ["", *integrity_summary(report["integrity"])]
    blocks.append(f"ran in {report['elapsed_seconds']:.1f} s")
    return blocks


def _header(report: dict[str, Any]) -> str:
    """The sizes every medium ran with, and how to read the figures."""
    return (
        f"tierkv bench: {report['blocks']} blocks of {format_size(report['block_bytes'])} "
        f"({format_size(report['total_bytes'])}) per medium, {report['batch']} blocks per "
        f"call, {report['concurrency']} calls in flight, median of {report['repeat']} "
        f"(min..max); MB/s = 10^6 bytes/s; latency per batch"
        + "".join(
            f"; {m['medium']} io engine: {m['io_engine']}"
            for m in report["media"]
            if m.get("io_engine")
        )
    )


def _media(media: list[dict[str, Any]]) -> list[Block]:
    """The table of tierkv against the raw medium, a store and a load row per medium,
    and under it what each medium's raw baseline was."""
    rows = []
    for m in media:
        for phase in ("store", "load"):
            entry = m[phase]
            mine, raw = entry["tierkv"], entry["raw"]
            rows.append(
                [
                    m["medium"] if phase == "store" else "",
                    phase,
                    _rate(mine),
                    _rate(raw) if raw else "-",
                    f"{entry['ratio']:.2f}" if entry["ratio"] is not None else "n/a",
                    f"{mine['p50_ms']:.2f} / {mine['p99_ms']:.2f}",
                    f"{raw['p50_ms']:.2f} / {raw['p99_ms']:.2f}" if raw else "-",
                ]
            )
    headers = [
        "medium",
        "phase",
        "tierkv MB/s",
        "raw MB/s",
        "ratio",
        "tierkv p50/p99 ms",
        "raw p50/p99 ms",
    ]
    baselines = [
        f"  {m['medium']}: raw = {m['baseline'] or 'no baseline for this tier type'}" for m in media
    ]
    return [TextTable(headers, rows), *baselines]


_ORCHESTRATOR_OPERATIONS = (
    ("store", "store (new keys)"),
    ("lookup_hit", "lookup (resident)"),
    ("lookup_miss", "lookup (unknown, asks the tier)"),
    ("load", "load (resident)"),
)
"""The orchestrator's measured operations: the report's key, the table's label."""


def _orchestrator_table(orch: dict[str, Any]) -> TextTable:
    """Keys and calls per second of each bookkeeping operation, no I/O."""
    return TextTable(
        ["operation", "keys/s", "calls/s"],
        [
            [
                label,
                f"{orch[f'{key}_keys_per_s']:,.0f}",
                f"{orch[f'{key}_calls_per_s']:,.0f}",
            ]
            for key, label in _ORCHESTRATOR_OPERATIONS
        ],
        title=f"orchestrator bookkeeping, {orch['resident_keys']:,} resident keys, "
        f"{orch['keys_per_call']} keys per call, no I/O",
    )


def _streaming(stream: dict[str, Any]) -> list[Block]:
    """The streaming table (tierkv, raw and one-file rates and CPU per block, store
    and load), what the two baselines were, and the promotion against its stages."""
    nbytes = stream["request_bytes"]

    def rate(key: str) -> str:
        low, high = stream[f"{key}_spread_seconds"]
        return (
            f"{nbytes / stream[f'{key}_seconds'] / 1e6:,.0f} "
            f"({nbytes / high / 1e6:,.0f}..{nbytes / low / 1e6:,.0f})"
        )

    table = TextTable(
        [
            "phase",
            "tierkv MB/s",
            "raw MB/s",
            "ratio",
            "one-file MB/s",
            "ratio to one file",
            "CPU us/block tierkv / raw / one-file",
        ],
        [
            [
                phase,
                rate(phase),
                rate(f"raw_{phase}"),
                f"{stream[f'{phase}_ratio']:.2f}",
                rate(f"one_file_{phase}"),
                f"{stream[f'one_file_{phase}_ratio']:.2f}",
                " / ".join(
                    f"{stream[f'{side}_cpu_us_per_block']:,.0f}"
                    for side in (phase, f"raw_{phase}", f"one_file_{phase}")
                ),
            ]
            for phase in ("store", "load")
        ],
        title=f"streaming: one {format_size(stream['request_bytes'])} request "
        f"through a {format_size(stream['primary_bytes'])} primary and nvme",
    )
    promotion = (
        f"  promotion: {stream['load_seconds'] * 1e3:,.0f} ms in {stream['windows']} "
        f"windows; stage 1 alone {stream['stage1_seconds'] * 1e3:,.0f} ms, stage 2 "
        f"alone {stream['stage2_seconds'] * 1e3:,.0f} ms: "
        f"{stream['promotion_vs_slower_stage']:.2f}x the slower stage"
    )
    if "native_store_MBps" in stream:
        native = (
            f"  native reference = {stream['native_baseline']}: store "
            f"{rate('native_store')} MB/s, load {rate('native_load')} MB/s; tierkv is "
            f"{stream['native_store_ratio']:.2f}x / {stream['native_load_ratio']:.2f}x of it; "
            f"CPU us/block {stream['native_store_cpu_us_per_block']:,.0f} / "
            f"{stream['native_load_cpu_us_per_block']:,.0f}"
        )
    else:
        native = f"  native reference: none ({stream.get('native_missing', 'not run')})"
    return [
        table,
        f"  raw = {stream['baseline']}",
        f"  one-file = {stream['one_file_baseline']} (one file, for reference)",
        native,
        promotion,
    ]


def _bookkeeping_line(orch: dict[str, Any]) -> str:
    """The orchestrator's per-block and per-key costs."""
    return (
        f"  bookkeeping: {orch['load_1024_us_per_block']:.2f} us/block on 1,024-block "
        f"loads; lookup {1e6 / orch['lookup_hit_keys_per_s']:.2f} us/key at "
        f"{orch['resident_keys']:,} resident keys; host tensor store "
        f"{orch['host_store_us_per_key_beyond_copy']:.2f} / load "
        f"{orch['host_load_us_per_key_beyond_copy']:.2f} us/key beyond the copy"
    )


def _admission_line(costs: dict[str, dict[str, float]]) -> str:
    """Each admission policy's CPU per block looked up, per ask size."""
    sizes = list(next(iter(costs.values())))
    per_policy = "; ".join(
        f"{name} " + " / ".join(f"{cost[size]:.2f}" for size in sizes)
        for name, cost in costs.items()
    )
    asks = " / ".join(f"{int(size):,}" for size in sizes)
    return f"  admission (lookup + store decision): us/block at {asks}-block asks: {per_policy}"


def _rate(side: dict[str, Any]) -> str:
    low, high = side["spread"]
    return f"{side['MBps']:,.0f} ({low:,.0f}..{high:,.0f})"
