"""The bench's report for the terminal: the media table, the orchestrator's
bookkeeping, the streaming phase and the integrity section, with every figure that
misses its target flagged (`MISSED`) and a last line counting the targets met."""

from __future__ import annotations

from typing import Any

from tierkv.bench.integrity import integrity_summary
from tierkv.bench.targets import TARGET, check_targets, missed_targets
from tierkv.contract.units import format_size
from tierkv.demo.report import Block, TextTable

MISSED = "MISSED"
"""The flag beside a figure that misses its target."""


def bench_summary(report: dict[str, Any]) -> list[Block]:
    """Lines and tables for the terminal: the media, then each optional section the
    report holds (orchestrator, streaming, bookkeeping targets, integrity), then the
    count of targets met."""
    checked = check_targets(report)
    orch = report.get("orchestrator")
    stream = report.get("streaming")
    blocks: list[Block] = [_header(report), "", *_media(report["media"])]
    if orch:
        blocks += ["", _orchestrator_table(orch)]
    if stream:
        blocks += ["", *_streaming(stream, checked)]
    if orch and "load_1024_us_per_block" in orch:
        blocks.append(_bookkeeping_line(orch, checked))
    if report.get("integrity"):
        blocks += ["", *integrity_summary(report["integrity"])]
    if checked:
        blocks.append(_targets_line(checked))
    blocks.append(f"ran in {report['elapsed_seconds']:.1f} s")
    return blocks


def _missed(checked: dict[str, dict[str, Any]], name: str) -> bool:
    """Whether target `name` was checked and missed (an unchecked one never is)."""
    return name in checked and not checked[name]["met"]


def _flag(checked: dict[str, dict[str, Any]], name: str) -> str:
    """What follows a target's text, `(target <= 5: MISSED)`, when it missed."""
    return f": {MISSED}" if _missed(checked, name) else ""


def _header(report: dict[str, Any]) -> str:
    """The sizes every medium ran with, and how to read the figures."""
    return (
        f"tierkv bench: {report['blocks']} blocks of {format_size(report['block_bytes'])} "
        f"({format_size(report['total_bytes'])}) per medium, {report['batch']} blocks per "
        f"call, {report['concurrency']} calls in flight, median of {report['repeat']} "
        f"(min..max); MB/s = 10^6 bytes/s; latency per batch"
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


def _streaming(stream: dict[str, Any], checked: dict[str, dict[str, Any]]) -> list[Block]:
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
            f"ratio (target {TARGET['streaming_store_ratio'].text})",
            "one-file MB/s",
            "ratio to one file",
            "CPU us/block tierkv / raw / one-file",
        ],
        [
            [
                phase,
                rate(phase),
                rate(f"raw_{phase}"),
                f"{stream[f'{phase}_ratio']:.2f}"
                + (f" {MISSED}" if _missed(checked, f"streaming_{phase}_ratio") else ""),
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
        f"{stream['promotion_vs_slower_stage']:.2f}x the slower stage "
        f"(target {TARGET['promotion_vs_slower_stage'].text}"
        f"{_flag(checked, 'promotion_vs_slower_stage')})"
    )
    return [
        table,
        f"  raw = {stream['baseline']}",
        f"  one-file = {stream['one_file_baseline']} (one file, for reference)",
        promotion,
    ]


def _bookkeeping_line(orch: dict[str, Any], checked: dict[str, dict[str, Any]]) -> str:
    """The orchestrator's per-block and per-key costs, each beside its target."""
    # the host tensor's store and load share one target text
    host = [s for s in ("store", "load") if _missed(checked, f"host_{s}_us_per_key_beyond_copy")]
    host_flag = f": {' and '.join(host)} {MISSED}" if host else ""
    return (
        f"  bookkeeping: {orch['load_1024_us_per_block']:.2f} us/block on 1,024-block "
        f"loads (target {TARGET['load_1024_us_per_block'].text}"
        f"{_flag(checked, 'load_1024_us_per_block')}); lookup "
        f"{1e6 / orch['lookup_hit_keys_per_s']:.2f} us/key at "
        f"{orch['resident_keys']:,} resident keys (target "
        f"{TARGET['lookup_us_per_key'].text}{_flag(checked, 'lookup_us_per_key')}); host "
        f"tensor store {orch['host_store_us_per_key_beyond_copy']:.2f} / load "
        f"{orch['host_load_us_per_key_beyond_copy']:.2f} us/key beyond the copy "
        f"(target {TARGET['host_store_us_per_key_beyond_copy'].text}"
        f"{host_flag})"
    )


def _targets_line(checked: dict[str, dict[str, Any]]) -> str:
    """How many targets were met, and the text of each one missed."""
    misses = missed_targets(checked)
    if misses:
        return (
            f"targets: {len(checked) - len(misses)} of {len(checked)} met; "
            f"{MISSED}: {'; '.join(misses)}"
        )
    return f"targets: all {len(checked)} met"


def _rate(side: dict[str, Any]) -> str:
    low, high = side["spread"]
    return f"{side['MBps']:,.0f} ({low:,.0f}..{high:,.0f})"
