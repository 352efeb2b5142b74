"""The manual's `--kv-transfer-config` (docs/vllm.md) is valid JSON whose tierkv
entries validate."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tierkv.integrations.vllm import VllmGeometry, resolve_entry

PAGE = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def test_the_manual_kv_transfer_config_validates() -> None:
    section = PAGE.read_text()
    match = re.search(r"--kv-transfer-config '(\{.*?\})'", section, re.S)
    assert match, "no --kv-transfer-config under 'Use with vLLM'"
    config = json.loads(match.group(1))
    assert config["kv_connector"] == "OffloadingConnector"
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    geometry = VllmGeometry("m", "bfloat16", (16,), 1, 16, 1 << 20, {"tp_size": 1}, {})
    entries = extra["secondary_tiers"]
    types = []
    for i, entry in enumerate(entries):
        fields = {k: v for k, v in entry.items() if k != "type"}
        types.append(resolve_entry(fields, geometry, where=f"secondary_tiers[{i}]").tier.type)
    assert types == ["nvme", "redis"]
