"""The capacity sweep (tierkv.trace.sweep): every cell, against the references."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.trace.conversations import ConversationSpec, generate, write_trace
from tierkv.trace.format import read_trace, request_keys
from tierkv.trace.reference import lru_hits
from tierkv.trace.sweep import (
    SWEEP_CAPACITIES,
    SWEEP_PRIMARIES,
    SweepOptions,
    baseline_policy,
    check_size,
    run_capacity_sweep,
    sweep_lines,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def conversations(tmp_path: Path) -> Path:
    path = tmp_path / "conv.jsonl"
    spec = ConversationSpec(sessions=24, turns=(2, 5), concurrent=6, first_tokens=(600, 3000))
    write_trace(generate(spec, seed=11), path)
    return path


async def test_every_cell_is_replayed_and_set_beside_the_lru_and_write_all(
    conversations: Path,
) -> None:
    options = SweepOptions(conversations, capacities=("5%", "27%", "50%"), primaries=("1%", "4"))
    report = await run_capacity_sweep(options)
    cells = report["cells"]
    wanted = [
        (p, c, a)
        for p in ("1%", "4")
        for c in ("5%", "27%", "50%")
        for a in ("all", "reuse", "tinylfu")
    ]
    assert [(c["primary"], c["tier_capacity"], c["admission"]) for c in cells] == wanted
    keys = [request_keys(r) for r in read_trace(conversations)]
    asked = sum(len(k) for k in keys)
    assert report["blocks_asked"] == asked and report["baseline"] == "all"
    for cell in cells:
        lru = lru_hits(keys, cell["tier_blocks"]) / asked
        assert cell["lru_hit_rate"] == pytest.approx(lru)
        assert cell["vs_lru"] == pytest.approx(cell["hit_rate"] / lru)
        (base,) = [
            c
            for c in cells
            if c["admission"] == "all"
            and (c["primary"], c["tier_capacity"]) == (cell["primary"], cell["tier_capacity"])
        ]
        assert cell["vs_baseline"] == pytest.approx(cell["hit_rate"] / base["hit_rate"])
        assert cell["written_vs_baseline"] == pytest.approx(
            cell["blocks_written"] / base["blocks_written"]
        )
        assert cell["blocks_written"] > 0 and cell["bytes_written"] >= 4096 * cell["blocks_written"]
        if cell["admission"] == "all":
            assert cell["declined_blocks"] == 0
        others = [
            c["hit_rate"]
            for c in cells
            if (c["primary"], c["tier_capacity"]) == (cell["primary"], cell["tier_capacity"])
            and c is not cell
        ]
        assert cell["vs_best_other"] == pytest.approx(cell["hit_rate"] / max(others))
    assert {c["primary_blocks"] for c in cells if c["primary"] == "4"} == {4}
    lines = sweep_lines(report)
    assert len([line for line in lines if " | " in line]) == 1 + 6  # the head, a row per size
    head = lines[2].split(" | ")
    assert [h.split()[0] for h in head[1:]] == ["all", "reuse", "tinylfu"]  # a column each
    assert head[3].split()[1:] == ["/LRU", "written", "/all", "wr/all", "/best"]
    row = lines[3].split(" | ")
    assert len(row[3].split()) == 6  # the tinylfu column's figures, /best included


async def test_a_sweep_of_one_policy_compares_it_with_itself(conversations: Path) -> None:
    options = SweepOptions(conversations, capacities=("20%",), primaries=("2%",))
    report = await run_capacity_sweep(
        SweepOptions(**{**options.__dict__, "admissions": ("reuse",)})
    )
    (cell,) = report["cells"]
    assert report["baseline"] == "reuse" and cell["vs_baseline"] == 1.0
    assert "reuse" in sweep_lines(report)[2]


def test_the_default_sizes_run_from_5_to_50_percent_at_two_primaries() -> None:
    assert SWEEP_CAPACITIES[0] == "5%" and SWEEP_CAPACITIES[-1] == "50%"
    assert SWEEP_PRIMARIES == ("0.5%", "2%")
    assert baseline_policy(["reuse", "all"]) == "all"


@pytest.mark.parametrize("good", ["5%", " 0.5% ", "100%", "12"])
def test_a_size_is_a_share_or_a_block_count(good: str) -> None:
    assert check_size(good) == good.strip()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("0%", "(0, 100]"),
        ("120%", "(0, 100]"),
        ("-5%", "(0, 100]"),
        ("lots", "not a block count or a percentage"),
        ("5.5", "not a block count or a percentage"),
        ("0", "at least 1 block"),
    ],
)
def test_a_bad_size_is_refused_naming_it(bad: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        check_size(bad)
    assert message in str(exc.value) and repr(bad.strip()) in str(exc.value)


async def test_a_sweep_replays_adaptive_admission(conversations: Path) -> None:
    options = SweepOptions(conversations, capacities=("12%",), primaries=("2%",))
    report = await run_capacity_sweep(
        SweepOptions(**{**options.__dict__, "admissions": ("all", "reuse", "adaptive")})
    )
    cells = {c["admission"]: c for c in report["cells"]}
    assert set(cells) == {"all", "reuse", "adaptive"}
    assert cells["adaptive"]["failed_loads"] == 0
    best = max(cells["all"]["hit_rate"], cells["reuse"]["hit_rate"])
    assert cells["adaptive"]["vs_best_other"] == pytest.approx(cells["adaptive"]["hit_rate"] / best)
    assert "adaptive" in sweep_lines(report)[2]
