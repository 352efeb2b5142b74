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
    assert report["whole_pages"] is False  # K and V of each layer: not evenly spaced
    assert any("page_first" in w for w in report["warnings"])


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


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
@pytest.mark.parametrize("mla", [False, True])
def test_the_geometry_is_the_host_pools(rig: Any, layout: str, mla: bool) -> None:
    """What the check computes is what the pool reports at start-up."""
    from tierkv.integrations.sglang.check import Model
    from tierkv.integrations.sglang.pages import read_geometry

    pool = rig.pool(pages=2, page_size=16, layer_num=3, head_num=2, head_dim=64,
                    layout=layout, mla=mla)
    model = Model(name="m", page_size=16, layers=3, kv_heads=2, head_dim=64,
                  layout=layout, mla=mla)
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
