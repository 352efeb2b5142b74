"""`tierkv plugins` (tierkv.cli.plugins): installed tier types with package, version,
class and config fields; exit 1 for a broken plugin."""

from __future__ import annotations

import json
from typing import Any

import pytest

import tierkv
from tierkv.cli import main
from tierkv.contract.errors import PluginImportError


def test_plugins_lists_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    assert "memory" in capsys.readouterr().out


def test_plugins_lists_packages_versions_and_config_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    memory = report["types"]["memory"]
    assert memory["distribution"] == "tierkv-cache" and memory["version"] == tierkv.__version__
    assert memory["target"] == "tierkv.memory_tier:MemoryTier"
    capacity = memory["fields"]["capacity"]
    assert capacity["default"] == 1 << 30 and capacity["unit"] == "bytes"
    assert capacity["default_text"] == "1GiB"
    assert "write_policy" not in memory["fields"]  # common fields are listed once
    common = report["common_fields"]
    assert common["write_policy"]["default"] == "write_through"
    assert common["required"]["default"] is True and common["required"]["default_text"] == "true"
    assert common["job_timeout"]["default"] == 30.0 and common["job_timeout"]["unit"] == "seconds"
    assert common["job_timeout"]["default_text"] == "30s"
    assert common["max_inflight_bytes"]["default"] == 256 << 20
    assert common["name"]["default"] is None and not common["name"]["required"]
    nvme = report["types"].get("nvme")
    if nvme is not None:  # installed in CI and in the dev setup
        assert nvme["distribution"] == "tierkv-cache-nvme"
        assert (
            nvme["fields"]["path"]["required"] and nvme["fields"]["io_concurrency"]["default"] == 8
        )

    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "memory" in text and "tierkv.memory_tier:MemoryTier" in text
    assert "every tier also takes" in text and "write_through_selective" in text


def test_plugins_reports_a_broken_plugin_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tierkv import registry

    real = registry.get_tier_class

    def flaky(name: str) -> Any:
        if name == "memory":
            raise PluginImportError("tier type 'memory' failed to import: ImportError: boom")
        return real(name)

    monkeypatch.setattr(registry, "get_tier_class", flaky)  # the command imports it on run
    assert main(["plugins"]) == 1
    assert "memory: BROKEN: tier type 'memory' failed to import" in capsys.readouterr().out


def test_a_size_default_written_as_an_int_is_shown_as_a_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The README's plugin writes `capacity: Size = Field(default=1 << 20)`: the
    default is listed as 1MiB (1048576 in JSON), never as 1.04858e+06."""
    from pydantic import Field

    from tierkv.memory_tier import MemoryTier
    from tierkv.registry import register_tier, unregister_tier
    from tierkv.tier import Size, TierConfig

    class SmallConfig(TierConfig):
        capacity: Size = Field(default=1 << 20, gt=0, description="bytes kept")

    class SmallTier(MemoryTier):
        Config = SmallConfig  # type: ignore[assignment]

        @staticmethod
        def get_tier_type() -> str:
            return "small"

    register_tier(SmallTier)
    try:
        assert main(["plugins"]) == 0
        text = capsys.readouterr().out
        assert main(["plugins", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
    finally:
        unregister_tier("small")
    assert "e+06" not in text and "1MiB" in text
    assert report["types"]["small"]["fields"]["capacity"]["default"] == 1 << 20
