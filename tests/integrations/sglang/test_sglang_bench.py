"""`scripts/bench_sglang.py` still runs: one small round of tierkv's nvme tier beside
SGLang's own `file` backend (every page it reads is checked by the script itself)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "bench_sglang.py"


def test_one_small_round(rig: Any, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_sglang", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.bench(64, 1, 1, tmp_path, "never", 2)
    assert row["pages_per_round"] == 128
    assert row["tierkv_get"] > 0 and row["file_get"] > 0
    assert row["tierkv_set"] > 0 and row["file_set"] > 0


def test_one_region_pages(rig: Any, tmp_path: Path) -> None:
    """`--regions 1`: tierkv's pool has one region a page of the same size; the `file`
    backend's pool stays MHA."""
    spec = importlib.util.spec_from_file_location("bench_sglang", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    one, two = bench.pool_of(64, 2, regions=1), bench.pool_of(64, 2)
    for pool, parts in ((one, 1), (two, 2)):
        ptrs, sizes = pool.get_page_buffer_meta(pool.indices([0]))
        assert len(ptrs) == parts and sum(sizes) == 64 << 10
    row = bench.bench(64, 1, 1, tmp_path, "never", 2, regions=1)
    assert row["regions"] == 1 and row["tierkv_get"] > 0 and row["file_get"] > 0


def test_a_full_tier_round(rig: Any, tmp_path: Path) -> None:
    """`--full`: the nvme tier holds one round's pages and is filled first, so every
    measured set evicts; the script still checks every page it reads back."""
    spec = importlib.util.spec_from_file_location("bench_sglang", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.bench(64, 1, 2, tmp_path, "never", 2, full=True)
    assert row["tierkv_set"] > 0 and row["tierkv_get"] > 0
