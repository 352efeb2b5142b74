"""`tierkv bench trace --plot FILE.png`: hit rate and bytes written to the tiers
against tier capacity, one line per admission policy, beside the trace's references.
Needs matplotlib (the `plot` extra)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def plot_trace(report: Mapping[str, Any], path: str | Path) -> Path:
    """Write the plot of a `run_trace_bench` report to `path` (PNG); return it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib: pip install matplotlib (the `plot` extra of tierkv-cache)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    policies = list(dict.fromkeys(r["admission"] for r in runs))
    fig, (hits, written) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    try:
        for policy in policies:
            mine = sorted(
                (r for r in runs if r["admission"] == policy), key=lambda r: r["tier_blocks"]
            )
            xs = [r["tier_blocks"] for r in mine]
            hits.plot(xs, [100 * r["hit_rate"] for r in mine], "o-", label=f"admission {policy}")
            written.plot(
                xs, [sum(r["bytes_written"].values()) / 2**20 for r in mine], "o-",
                label=f"admission {policy}",
            )  # fmt: skip
        ref = sorted({(r["tier_blocks"], r["lru_tier_only_hit_rate"]) for r in runs})
        hits.plot(
            [x for x, _ in ref],
            [100 * y for _, y in ref],
            "k--",
            label="plain LRU of the tier's size",
        )
        hits.axhline(
            100 * report["infinite_cache_hit_rate"],
            color="grey",
            linestyle=":",
            label="infinite cache",
        )
        hits.set_xlabel("tier capacity (blocks)")
        hits.set_ylabel("prefix hit rate (% of requested blocks)")
        hits.set_ylim(bottom=0)
        written.set_xlabel("tier capacity (blocks)")
        written.set_ylabel("written to the tiers (MiB at the replay's block size)")
        written.set_ylim(bottom=0)
        for ax in (hits, written):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(
            f"tierkv bench trace: {Path(report['trace']).name}, {report['requests']:,} requests",
            fontsize=10,
        )
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out
