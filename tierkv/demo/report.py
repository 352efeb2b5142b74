"""Summaries for the terminal: small tables printed with rich when it is installed,
as aligned plain text otherwise (and always when the output is not a terminal and
rich is missing)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from tierkv.contract.units import approx_size
from tierkv.demo.groups import compared_to_full, describe_group
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM


@dataclass
class TextTable:
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    title: str | None = None
    align: str = ""  # one of "l"/"r" per column; default: first left, rest right

    def column_align(self, i: int) -> str:
        if i < len(self.align):
            return self.align[i]
        return "l" if i == 0 else "r"


Block = str | TextTable


def have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def render(blocks: list[Block], out: TextIO | None = None, *, use_rich: bool | None = None) -> None:
    """Print lines and tables to `out` (stdout)."""
    out = out or sys.stdout
    if use_rich is None:
        use_rich = have_rich()
    if use_rich:
        _render_rich(blocks, out)
    else:
        _render_plain(blocks, out)


def _render_rich(blocks: list[Block], out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table

    # not a terminal (a pipe, a file): wide enough that tables never wrap
    width = None if out.isatty() else 200

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich's own answer is SystemExit(1); the command's is exit 141 (a Unix
            # tool killed by SIGPIPE), which `tierkv.cli.app.main` gives a BrokenPipeError
            raise BrokenPipeError(32, "Broken pipe")

    console = _Console(file=out, highlight=False, soft_wrap=True, width=width)
    for block in blocks:
        if isinstance(block, str):
            console.print(block, markup=False)
            continue
        table = Table(title=block.title, title_justify="left", show_edge=False, pad_edge=False)
        for i, header in enumerate(block.headers):
            table.add_column(header, justify="left" if block.column_align(i) == "l" else "right")
        for row in block.rows:
            table.add_row(*row)
        console.print(table)


def _render_plain(blocks: list[Block], out: TextIO) -> None:
    for block in blocks:
        if isinstance(block, str):
            print(block, file=out)
            continue
        if block.title:
            print(block.title, file=out)
        cells = [block.headers, *block.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(block.headers))]
        for row in cells:
            parts = [
                cell.ljust(w) if block.column_align(i) == "l" else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            ]
            print("  ".join(parts).rstrip(), file=out)


def human_bytes(n: float) -> str:
    """`1.5 MiB`: one decimal, for tables."""
    return approx_size(n, sep=" ")


COLUMN_TITLES = {
    "no_cache": "no cache",
    "gpu_prefix_cache": "GPU prefix cache",
    "tierkv": "GPU prefix cache + tierkv",
}


def demo_summary(report: dict[str, Any]) -> list[Block]:
    """The demo's closing summary: setup, TTFT in three columns, where the reused
    blocks came from, correctness."""
    blocks: list[Block] = [*_setup(report), ""]
    blocks += _ttft_table(report)
    blocks.append("")
    blocks += _served_from(report)
    blocks += _earlier_run(report.get("earlier_run") or {})
    blocks += _groups(report.get("groups") or [], report["kv_cache"]["block_bytes"])
    blocks.append("")
    blocks += _correctness(report["correctness"])
    if report.get("plot"):
        blocks.append(f"plot: {report['plot']}")
    if report.get("metrics_url"):
        blocks.append(f"metrics: {report['metrics_url']}")
    blocks.append(f"ran in {report['elapsed_seconds']:.1f} s")
    return blocks


def _setup(report: dict[str, Any]) -> list[Block]:
    """What ran: the workload, the model (and a hybrid's layer kinds), the KV cache,
    the chain, and where the tiers kept their files."""
    m, kv, wl, chain = report["model"], report["kv_cache"], report["workload"], report["chain"]
    tiers = " -> ".join(
        ["primary", *(f"{t['name']} ({t['write_policy']})" for t in chain["tiers"])]
    )
    gpu = report["gpu_prefix_cache"]["tierkv"]
    lines: list[Block] = [
        f"tierkv demo: {wl['users']} users x {wl['turns']} turns, system prompt "
        f"{wl['system_tokens']} tokens, {wl['message_tokens']} tokens per message, "
        f"{wl['reply_tokens']} per reply",
        f"model: {m['layers']} layers x {m['hidden']} hidden, {m['heads']} heads, vocab "
        f"{m['vocab']} ({m['parameters'] / 1e6:.1f}M parameters, random weights seed "
        f"{m['seed']}) on {m['device']}, {m['dtype']}, {m['torch_threads']} torch threads",
    ]
    hybrid = m.get("hybrid")
    if hybrid:
        kinds = ["full" if i % 2 == 0 else hybrid["kind"] for i in range(m["layers"])]
        window = f" (window {hybrid['window']} tokens)" if hybrid.get("window") else ""
        lines.append(f"hybrid: layers {', '.join(kinds)}{window}; one KV group per kind")
    lines += [
        f"KV cache per engine: {kv['gpu_blocks']} blocks x {kv['gpu_block_tokens']} tokens "
        f"(its GPU prefix cache: {gpu['capacity_blocks']} blocks of "
        f"{kv['offloaded_block_tokens']} tokens); offloaded block "
        f"{human_bytes(kv['block_bytes'])}",
        f"chain: {tiers}; primary {chain['primary_capacity']} = "
        f"{chain['primary_blocks']} blocks ({chain['eviction']})",
    ]
    files = report.get("tier_files")
    if files and files["paths"] and files["temporary"]:
        lines.append("tier files: in a temporary directory, removed at exit")
    elif files and files["paths"]:
        kept = "; ".join(f"{t} {', '.join(p)}" for t, p in files["paths"].items())
        lines.append(f"tier files: kept ({kept})")
    return lines


def _ttft_table(report: dict[str, Any]) -> list[Block]:
    """TTFT and prefill tokens per column, the speed-ups against no cache, and
    tierkv's against the GPU prefix cache alone."""
    ttft, columns, prefill = report["ttft"], report["columns"], report["prefill_tokens"]
    rows = [
        [label, *(f"{ttft[c][key]:.1f} ms" for c in columns)]
        for label, key in (("TTFT mean", "mean_ms"), ("TTFT p50", "p50_ms"), ("TTFT p90", "p90_ms"))
    ]
    rows.append(["prefill tokens", *(f"{prefill[c]:,}" for c in columns)])
    rows.append(
        [
            "speed-up (TTFT)",
            "1.00x",
            f"{ttft['gpu_prefix_cache_vs_no_cache']:.2f}x",
            f"{ttft['speedup_vs_no_cache']:.2f}x",
        ]
    )
    return [
        TextTable(["", *(COLUMN_TITLES[c] for c in columns)], rows),
        f"tierkv over the GPU prefix cache alone: {ttft['speedup']:.2f}x TTFT "
        f"({ttft['speedup_returning_turns']:.2f}x on returning turns)",
    ]


def _served_from(report: dict[str, Any]) -> list[Block]:
    """Where the tierkv column's reusable blocks came from (the GPU prefix cache,
    each medium, or nowhere: recomputed), and what the stores and loads did."""
    rows = [["GPU prefix cache", f"{report['gpu_hit_rate']:.1%}", "", "", ""]]
    for name, data in report["tiers"].items():
        rows.append(
            [
                "primary (cpu)" if name == PRIMARY_MEDIUM else name,
                f"{data['hit_rate']:.1%}",
                f"{data['blocks_served']:,}",
                human_bytes(data["bytes_in"]),
                human_bytes(data["bytes_out"]),
            ]
        )
    rows.append(["recomputed", f"{report['recomputed_block_rate']:.1%}", "", "", ""])
    table = TextTable(
        ["served from", "share", "blocks", "bytes in", "bytes out"],
        rows,
        title=f"GPU prefix cache + tierkv: {report['reusable_blocks']:,} reusable prompt blocks",
    )
    skipped = (
        f"; {report['skipped_blocks']:,} window blocks or states not stored "
        "(no checkpoint's hit needs them)"
        if report.get("skipped_blocks")
        else ""
    )
    return [
        table,
        f"stored {report['stored_blocks']:,} new blocks ({report['rejected_blocks']:,} "
        f"rejected: no room in the chain); {report['load_failures']:,} blocks failed to load"
        + skipped,
    ]


def _correctness(corr: dict[str, Any]) -> list[Block]:
    """The verdict over every turn; when it failed, which column went wrong, and
    where first."""
    verdict = "OK" if corr["ok"] else "FAILED"
    lines: list[Block] = [
        f"correctness: greedy tokens identical in {corr['tokens_identical_turns']}/"
        f"{corr['turns']} turns (every column vs no cache); max |logit difference| "
        f"{corr['max_logit_diff']:.2e} (tolerance {corr['atol']:.0e}): {verdict}"
    ]
    if corr["ok"]:
        return lines
    names = {"gpu_prefix_cache": "GPU prefix cache", "tierkv": "GPU prefix cache + tierkv"}
    for column, seen in (corr.get("by_column") or {}).items():
        first = seen["first_differing_turn"]
        lines.append(
            f"  {names.get(column, column)}: identical in {seen['tokens_identical_turns']}/"
            f"{corr['turns']} turns, max |logit difference| {seen['max_logit_diff']:.2e}"
            + (f", first differs at {first}" if first else "")
        )
    return lines


def _groups(groups: list[dict[str, Any]], block_bytes: int) -> list[Block]:
    """A hybrid run's traffic per KV group, and the other kind's against full attention."""
    if len(groups) < 2:
        return []
    rows = [
        [
            f"{g['group']} {describe_group(g)}",
            str(g["layers"]),
            human_bytes(g["payload_bytes"]),
            f"{g['blocks_stored']:,}",
            human_bytes(g["bytes_stored"]),
            f"{g['blocks_loaded']:,}",
            human_bytes(g["bytes_loaded"]),
        ]
        for g in groups
    ]
    table = TextTable(
        ["KV group", "layers", "data/block", "stored", "bytes", "loaded", "bytes"],
        rows,
        title="per KV group (tierkv column; every block moves as one "
        f"{human_bytes(block_bytes)} row)",
    )
    out: list[Block] = ["", table]
    ratio = compared_to_full(groups)
    if ratio is not None:
        out.append(
            f"{describe_group(groups[1])} layers moved {ratio['loaded']:.0%} of the bytes the "
            f"full-attention layers of the same size loaded, {ratio['stored']:.0%} of what they "
            "stored"
        )
    return out


def _earlier_run(earlier: dict[str, Any]) -> list[Block]:
    """A line when the tiers held blocks before the run began (a kept directory, a
    shared server): those blocks change the shares, so the report says so."""
    at_start = {name: n for name, n in earlier.get("blocks_at_start", {}).items() if n}
    served = earlier.get("served_blocks", 0)
    if not at_start and not served:
        return []
    found = sum(at_start.values())
    where = ", ".join(f"{name} {n:,}" for name, n in at_start.items())
    head = f"{found:,} blocks found from an earlier run ({where}); " if at_start else ""
    origin = "it" if at_start else "an earlier run"
    return [
        f"{head}{served:,} blocks served came from {origin}, so the shares are not a fresh run's"
    ]
