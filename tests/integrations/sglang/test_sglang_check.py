"""`tierkv sglang check`: the extra config read as the backend will read it, offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tierkv.cli import main

BACKEND = {
    "backend_name": "tierkv",
    "module_path": "tierkv.integrations.sglang",
    "class_name": "TierkvHiCacheStorage",
    "interface_v1": 1,
}


def extra(tmp_path: Path, **fields: Any) -> str:
    nvme = {"type": "nvme", "path": str(tmp_path / "kv"), "capacity": "1GiB"}
    tiers = [{**nvme, "job_timeout": "2s"}]
    return json.dumps({**BACKEND, "tiers": tiers, **fields})


def test_a_good_config(tmp_path: Path, capsys: pytest.CaptureFixture[str], rig: Any) -> None:
    assert main(["sglang", "check", extra(tmp_path), "--model", "org/m", "--layers", "4"]) == 0
    out = capsys.readouterr().out
    # 64 tokens x 8 heads x 128 x 2 B x 4 layers; K and V half a buffer apart, and nvme
    # accepts regions: a page is one block
    assert "2 regions of 524288 bytes, one tierkv block of them all" in out
    assert "namespace: sglang:org/m:bfloat16:64t:page_first:tp0of1:" in out
    assert "get/set answer within 3s" in out
    assert "SGLang loads tierkv.integrations.sglang.TierkvHiCacheStorage: yes" in out
    assert not (tmp_path / "kv").exists()  # opens nothing


def test_json_and_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], rig: Any) -> None:
    path = tmp_path / "extra.json"
    path.write_text(extra(tmp_path))
    assert main(["sglang", "check", f"@{path}", "--json", "--layout", "layer_first"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parts_per_page"] == 64 and report["tiers"][0]["type"] == "nvme"
    # K and V of each layer, 64 regions: one block of them all (nvme accepts regions)
    assert report["whole_pages"] is True and report["page_bytes"] == 64 * 131072
    assert not any("regions" in w for w in report["warnings"])


@pytest.mark.parametrize(
    ("fields", "flags", "said"),
    [
        ({"interface_v1": 0}, [], "extra_config.interface_v1: must be 1"),
        ({"class_name": "Other"}, [], "extra_config.class_name: 'Other'"),
        ({"tiers": [{"type": "nvme"}]}, [], "extra_config.tiers[0].path"),
        ({"lookup_timeout": "soon"}, [], "extra_config.lookup_timeout"),
        ({}, ["--mla", "--tp", "2"], "TP rank 0 only"),
    ],
)
def test_problems_exit_2_with_their_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fields: dict[str, Any],
    flags: list[str], said: str,
) -> None:
    assert main(["sglang", "check", extra(tmp_path, **fields), *flags]) == 2
    assert said in capsys.readouterr().err


LAYOUT_CASES = [
    (layout, mla)
    for layout in ("page_first", "page_first_direct", "layer_first", "page_head",
                   "page_first_kv_split")
    for mla in (False, True)
    if not (layout == "page_head" and mla) and not (layout == "page_first_kv_split" and not mla)
]


@pytest.mark.parametrize(("layout", "mla"), LAYOUT_CASES)
def test_the_geometry_is_the_host_pools(rig: Any, layout: str, mla: bool) -> None:
    """What the check computes is what the pool reports at start-up."""
    from tierkv.integrations.sglang.check import Model
    from tierkv.integrations.sglang.pages import read_geometry

    pool = rig.pool(pages=2, page_size=16, layer_num=3, head_num=2, head_dim=64,
                    layout=layout, mla=mla, rope_dim=16)
    model = Model(name="m", page_size=16, layers=3, kv_heads=2, head_dim=64,
                  layout=layout, mla=mla, rope_dim=16)
    read = read_geometry(pool, model="m", tp_rank=0, tp_size=1, is_mla=mla)
    assert read == model.geometry()


def test_sglang_own_fields_may_stand_beside(tmp_path: Path, rig: Any) -> None:
    """The prefetch settings SGLang takes out of the extra config itself, and the
    fields it reads and leaves in (allocator, file_storage_path) are not typos."""
    fields = {"prefetch_threshold": 128, "hicache_storage_pass_prefix_keys": True,
              "allocator": "default", "file_storage_path": "/tmp/x"}
    assert main(["sglang", "check", extra(tmp_path, **fields)]) == 0


def test_a_tier_that_moves_one_run_of_bytes_keeps_regions_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rig: Any
) -> None:
    nvme = {"type": "nvme", "path": str(tmp_path / "kv"), "capacity": "1GiB"}
    tiers = [nvme, {"type": "sqlite", "path": str(tmp_path / "kv.db"), "capacity": "1GiB"}]
    config = json.dumps({**BACKEND, "tiers": tiers})
    assert main(["sglang", "check", config, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["whole_pages"] is False


@pytest.mark.parametrize(("layout", "mla"), LAYOUT_CASES)
@pytest.mark.parametrize("regions", [True, False])
def test_the_check_says_which_layouts_are_one_block_a_page(
    tmp_path: Path, layout: str, mla: bool, regions: bool
) -> None:
    """Every layout SGLang 0.5.23 offers: a page of several regions is one block where
    every tier accepts regions, a block a region otherwise; an MLA page_first page is
    one region anyway."""
    from tierkv.integrations.sglang.check import Model, check, render

    tiers: list[dict[str, Any]] = [{"type": "nvme", "path": str(tmp_path / "kv"),
                                    "capacity": "1GiB", "job_timeout": "2s"}]
    if not regions:
        tiers.append({"type": "sqlite", "path": str(tmp_path / "kv.db"), "capacity": "1GiB"})
    model = Model(name="m", layers=4, layout=layout, mla=mla, head_dim=576 if mla else 128)
    report = check(json.dumps({**BACKEND, "tiers": tiers}), model)
    several = report.parts_per_page > 1
    assert several == (not mla or layout in ("layer_first", "page_first_kv_split"))
    assert report.whole_pages == (several and regions)
    text = render(report, model)
    said = "one tierkv block of them all" if report.whole_pages else "each a tierkv block"
    assert said in text
    if layout == "page_first_kv_split":  # K: 512 wide, V: 64 (rope)
        assert report.region_bytes == [64 * 512 * 2 * 4, 64 * 64 * 2 * 4]
        assert "2 regions of 262144 + 32768 bytes" in text


def test_a_layout_of_the_other_kind_of_model_is_refused(tmp_path: Path) -> None:
    from tierkv.contract.errors import ConfigError
    from tierkv.integrations.sglang.check import Model, check

    for model in (Model(layout="page_head", mla=True), Model(layout="page_first_kv_split")):
        with pytest.raises(ConfigError, match="only"):
            check(extra(tmp_path), model)


def test_the_command_line_offers_every_layout_the_check_knows() -> None:
    from tierkv.cli import sglang as cli
    from tierkv.integrations.sglang import check

    assert cli.LAYOUTS == check.LAYOUTS
