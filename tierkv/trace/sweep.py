"""`tierkv bench trace FILE --capacity-sweep`: one replay per (primary size, tier
capacity, admission policy), all in one table, so a policy that wins at one size and
loses at another shows at once.

An admission rule judged at one or two capacities can hide a loss elsewhere: on a
conversation trace `reuse` served 1.74x write-all's hits with a tier of 5 % of the
distinct blocks and 0.57x at 40 % (issue 36). The sweep replays the trace through the
same machinery as `bench trace` (`tierkv.trace.replay.replay`, one request at a time,
every cascade finished before the next), with no backlog and no TTFT estimate, and
sets each run beside a plain LRU of the tier's size (`lru_hits`: what write-all over an
inclusive chain should serve) and beside the baseline policy at the same size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.contract.keys import OffloadKey
from tierkv.trace.format import TraceError, TraceRequest, read_trace, request_keys
from tierkv.trace.reference import infinite_cache_hits, lru_hits
from tierkv.trace.replay import ReplayOptions, primary_and_tier_blocks, replay

SWEEP_CAPACITIES = ("5%", "12%", "20%", "27%", "40%", "50%")
"""Tier capacities of the sweep, as shares of the trace's distinct blocks: from a tier
too small to hold one conversation's second turn to one holding half the trace."""
SWEEP_PRIMARIES = ("0.5%", "2%")
"""Primary sizes of the sweep: a primary so small that a block leaves it before its
second sighting, and the 2 % the manual's other replays use."""
REGRESSION = 0.98
"""A policy serving less than this share of the baseline's hits at some size is marked
in the table (`<`): the bar issue 36 sets for an admission rule."""

Keyed = Sequence[tuple[TraceRequest, Sequence[OffloadKey]]]


@dataclass(frozen=True)
class SweepOptions:
    path: Path
    limit: int | None = None
    block_bytes: int = 4 << 10
    primaries: tuple[str, ...] = SWEEP_PRIMARIES
    capacities: tuple[str, ...] = SWEEP_CAPACITIES
    tiers: tuple[str, ...] = ("memory",)
    admissions: tuple[str, ...] = ("all", "reuse", "tinylfu")
    directory: Path | None = None
    redis_url: str | None = None
    quotas: Mapping[str, Any] | None = field(default=None, hash=False)  # tenants.quotas


def check_size(text: str) -> str:
    """`text` as a sweep size: a share of the distinct blocks in (0, 100] % or a
    positive block count; raises ValueError naming the value otherwise (checked before
    the trace is read, so a typo costs nothing)."""
    item = text.strip()
    number = item[:-1] if item.endswith("%") else item
    try:
        value = float(number) if item.endswith("%") else int(number)
    except ValueError:
        raise ValueError(f"{item!r} is not a block count or a percentage (e.g. 5%)") from None
    if item.endswith("%") and not 0 < value <= 100:
        raise ValueError(f"{item!r}: a percentage must be in (0, 100]")
    if value < 1 and not item.endswith("%"):
        raise ValueError(f"{item!r}: at least 1 block")
    return item


def baseline_policy(admissions: Sequence[str]) -> str:
    """The policy the others are compared with: write-all where swept, else the first."""
    return "all" if "all" in admissions else admissions[0]


async def run_capacity_sweep(
    o: SweepOptions, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every cell of the sweep, as a JSON-able report (`cells`, in table order)."""
    say = progress or (lambda _: None)
    started = time.perf_counter()
    requests = read_trace(o.path, o.limit)
    keyed = [(r, request_keys(r)) for r in requests]
    only = [k for _, k in keyed]
    asked = sum(len(k) for k in only)
    if not asked:
        raise TraceError(f"{o.path}: no request asks for a block (every hash_ids is empty)")
    distinct = len({key for keys in only for key in keys})
    lru: dict[int, float] = {}  # tier blocks -> the same-size LRU's hit rate
    cells: list[dict[str, Any]] = []
    for primary in o.primaries:
        for capacity in o.capacities:
            p_blocks, t_blocks = primary_and_tier_blocks(distinct, primary, capacity)
            if t_blocks not in lru:
                lru[t_blocks] = lru_hits(only, t_blocks) / asked
            size = {
                "primary": primary,
                "primary_blocks": p_blocks,
                "tier_capacity": capacity,
                "tier_blocks": t_blocks,
                "lru_hit_rate": lru[t_blocks],
            }
            for admission in o.admissions:
                say(f"primary {primary}, tier {capacity}, admission {admission}")
                cells.append(await _cell(keyed, o, size, admission))
    _compare(cells, baseline_policy(o.admissions))
    return {
        "trace": str(o.path),
        "requests": len(requests),
        "blocks_asked": asked,
        "distinct_blocks": distinct,
        "infinite_cache_hit_rate": infinite_cache_hits(only) / asked,
        "tiers": list(o.tiers),
        "block_bytes": o.block_bytes,
        "baseline": baseline_policy(o.admissions),
        "cells": cells,
        "seconds": time.perf_counter() - started,
    }


async def _cell(
    keyed: Keyed, o: SweepOptions, size: Mapping[str, Any], admission: str
) -> dict[str, Any]:
    """One replay at one size and policy: what it served and wrote."""
    options = ReplayOptions(
        block_bytes=o.block_bytes,
        primary_blocks=size["primary_blocks"],
        tiers=o.tiers,
        tier_blocks=size["tier_blocks"],
        admission=admission,
        directory=o.directory,
        redis_url=o.redis_url,
        quotas=o.quotas,
    )
    report = await replay(keyed, options)
    lru = size["lru_hit_rate"]
    return {
        **size,
        "admission": admission,
        "hit_rate": report.hit_rate,
        "vs_lru": report.hit_rate / lru if lru else None,
        "bytes_written": sum(report.bytes_written.values()),
        "blocks_written": sum(report.blocks_written.values()),
        "declined_blocks": sum(report.declined.values()),
        "failed_loads": report.failed_loads,
        "seconds": report.seconds,
    }


def _compare(cells: list[dict[str, Any]], baseline: str) -> None:
    """Set each cell's served and written beside the baseline policy's at its size, and
    its served beside the best of the other policies there (`vs_best_other`: the bar
    issue 36 sets a new admission rule is >= REGRESSION of the better of the others)."""
    base = {(c["primary"], c["tier_capacity"]): c for c in cells if c["admission"] == baseline}
    for cell in cells:
        size = (cell["primary"], cell["tier_capacity"])
        ref = base[size]
        cell["vs_baseline"] = cell["hit_rate"] / ref["hit_rate"] if ref["hit_rate"] else None
        written = ref["blocks_written"]
        cell["written_vs_baseline"] = cell["blocks_written"] / written if written else None
        others = [
            c["hit_rate"]
            for c in cells
            if (c["primary"], c["tier_capacity"]) == size and c["admission"] != cell["admission"]
        ]
        best = max(others, default=0.0)
        cell["vs_best_other"] = cell["hit_rate"] / best if best else None


def _ratio(value: float | None, mark: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{'<' if mark and value < REGRESSION else ''}"


def sweep_lines(report: Mapping[str, Any]) -> list[str]:
    """The sweep as one table: a row per (primary, tier capacity), per policy its
    served share, served / same-size LRU and blocks written, and for the others their
    served and written / the baseline's."""
    cells = report["cells"]
    policies = list(dict.fromkeys(c["admission"] for c in cells))
    base = report["baseline"]
    best = len(policies) > 2  # then each policy beside the better of the others, too
    head = f"{'primary':>13} {'tier cap':>14} {'LRU':>6}"
    for policy in policies:
        head += f" | {policy:>7} {'/LRU':>5} {'written':>9}"
        if policy != base:
            head += f" {'/' + base:>6} {'wr/' + base:>6}"
            if best:
                head += f" {'/best':>6}"
    lines = [
        f"trace {report['trace']}: {report['requests']:,} requests, "
        f"{report['blocks_asked']:,} blocks asked, {report['distinct_blocks']:,} distinct; "
        f"an infinite cache serves {report['infinite_cache_hit_rate']:.1%}; tiers "
        f"{','.join(report['tiers'])}, {report['block_bytes']:,}-byte blocks",
        "",
        head,
    ]
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for cell in cells:
        rows.setdefault((cell["primary"], cell["tier_capacity"]), []).append(cell)
    for row in rows.values():
        first = row[0]
        line = (
            f"{first['primary']:>5} ({first['primary_blocks']:>5,}) "
            f"{first['tier_capacity']:>5} ({first['tier_blocks']:>6,}) "
            f"{first['lru_hit_rate']:>6.1%}"
        )
        for cell in row:
            line += (
                f" | {cell['hit_rate']:>7.1%} {_ratio(cell['vs_lru']):>5} "
                f"{cell['blocks_written']:>9,}"
            )
            if cell["admission"] != base:
                line += (
                    f" {_ratio(cell['vs_baseline'], mark=True):>6} "
                    f"{_ratio(cell['written_vs_baseline']):>6}"
                )
                if best:
                    line += f" {_ratio(cell['vs_best_other'], mark=True):>6}"
        lines.append(line)
    lines += [
        "",
        f"primary, tier cap: share of the distinct blocks (blocks); LRU: one plain LRU of "
        f"the tier's size (what write-all over an inclusive chain serves); per policy: "
        f"blocks served / asked (prefix), / LRU, blocks written to the tiers; /{base}, "
        f"wr/{base}: served and written / {base}'s at the same size"
        + (", /best: served / the best other policy's" if best else "")
        + f"; '<' under {REGRESSION}; {report['seconds']:.0f} s",
    ]
    return lines
