"""`tierkv demo --plot [FILE.png]`: time to first token of every turn, one line per
column (no cache, GPU prefix cache, GPU prefix cache + tierkv). Needs matplotlib, the
`plot` extra (`pip install -e '.[plot]'` from a checkout)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from tierkv.demo.report import COLUMN_TITLES

MISSING = "--plot needs matplotlib: pip install matplotlib (the `plot` extra of tierkv-cache)"


def check_available() -> None:
    """Raise ImportError with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(MISSING) from None


def plot_path(given: str | None = None) -> Path:
    """Where `--plot` writes: the file given (made absolute, for the message), or a new
    `tierkv-demo-ttft-*.png` in the temporary directory, never the current directory
    (which may be a checkout)."""
    if given:
        return Path(os.path.abspath(given))
    fd, name = tempfile.mkstemp(prefix="tierkv-demo-ttft-", suffix=".png")
    os.close(fd)
    return Path(name)


def plot_ttft(report: dict[str, Any], path: str | Path) -> Path:
    """Write the per-turn TTFT plot of a demo report to `path` (PNG); return it."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    turns = report["turns"]
    x = list(range(1, len(turns) + 1))
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=120)
    try:
        for column, style in zip(report["columns"], ("o-", "s-", "^-")):
            ys = [t["ttft"][column] * 1e3 for t in turns]
            ax.plot(x, ys, style, label=COLUMN_TITLES[column], markersize=4)
        m, wl = report["model"], report["workload"]
        ax.set_title(
            f"tierkv demo: {m['parameters'] / 1e6:,.1f}M-parameter model on {m['device']}, "
            f"{wl['users']} users x {wl['turns']} turns, "
            f"{wl['system_tokens']}-token system prompt",
            fontsize=10,
        )
        ax.set_xlabel("turn (users take turns round-robin)")
        ax.set_ylabel("time to first token (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out
