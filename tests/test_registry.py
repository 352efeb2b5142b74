"""Tier types resolve through the `tierkv.tiers` entry points, with errors that help."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.contract.errors import PluginImportError, UnknownTierType
from tierkv.memory_tier import MemoryTier, MemoryTierConfig
from tierkv.primary import PrimaryTier
from tierkv.registry import (
    KNOWN_TIER_PACKAGES,
    create_tier,
    get_tier_class,
    installed_tiers,
    register_tier,
    rescan,
    unregister_tier,
)


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path where tests lay out fake installed distributions."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("fake_tier")]:
        del sys.modules[name]


def install(root: Path, dist: str, entry_points: dict[str, str], module: str = "") -> None:
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"  # as pip names it
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[tierkv.tiers]\n{lines}\n")
    rescan()  # a distribution installed while the process runs
    if module:
        (root / f"{dist.replace('-', '_')}.py").write_text(textwrap.dedent(module))


def test_memory_tier_is_registered_through_the_entry_point_group() -> None:
    info = installed_tiers()["memory"]
    assert info.target == "tierkv.memory_tier:MemoryTier"
    assert info.distribution == "tierkv-cache"
    assert get_tier_class("memory") is MemoryTier


def test_unknown_type_lists_installed_types_and_the_package_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(KNOWN_TIER_PACKAGES, "floppy", "tierkv-floppy")
    with pytest.raises(UnknownTierType) as err:
        get_tier_class("floppy")
    text = str(err.value)
    assert "unknown tier type 'floppy'" in text
    assert "installed tier types:" in text and "memory" in text
    assert "pip install tierkv-floppy" in text


def test_unknown_third_party_type_explains_the_entry_point_group() -> None:
    with pytest.raises(UnknownTierType, match=r"'tierkv\.tiers' group"):
        get_tier_class("zipdrive")


def test_plugin_that_fails_to_import_names_package_and_cause(plugin_dir: Path) -> None:
    install(
        plugin_dir,
        "fake-tier-broken",
        {"broken": "fake_tier_broken:Tier"},
        module="import no_such_dependency_xyz\n",
    )
    assert "broken" in installed_tiers()  # listed even though it cannot import
    with pytest.raises(PluginImportError) as err:
        get_tier_class("broken")
    text = str(err.value)
    assert "fake-tier-broken 1.2.3" in text
    assert "ModuleNotFoundError" in text and "no_such_dependency_xyz" in text


def test_entry_point_to_a_non_tier_is_rejected(plugin_dir: Path) -> None:
    install(
        plugin_dir,
        "fake-tier-wrong",
        {"wrong": "fake_tier_wrong:Tier"},
        module="class Tier:\n    pass\n",
    )
    with pytest.raises(
        PluginImportError, match=r"not a subclass of tierkv\.tier\.SecondaryTierManager"
    ):
        get_tier_class("wrong")


def test_entry_point_name_must_match_the_declared_type(plugin_dir: Path) -> None:
    install(plugin_dir, "fake-tier-named", {"alias": "tierkv.memory_tier:MemoryTier"})
    with pytest.raises(PluginImportError, match="says its type is 'memory'"):
        get_tier_class("alias")


def test_two_packages_providing_one_type_is_an_error(plugin_dir: Path) -> None:
    install(plugin_dir, "fake-tier-a", {"dup": "fake_tier_a:T"})
    install(plugin_dir, "fake-tier-b", {"dup": "fake_tier_b:T"})
    with pytest.raises(PluginImportError, match="more than one package"):
        get_tier_class("dup")


def test_register_tier_without_an_entry_point() -> None:
    class LocalTier(MemoryTier):
        @staticmethod
        def get_tier_type() -> str:
            return "local-test"

    register_tier(LocalTier)
    try:
        assert get_tier_class("local-test") is LocalTier
        assert installed_tiers()["local-test"].distribution is None
        primary = PrimaryTier(2, 64, pin_memory=False)
        tier = create_tier(MemoryTierConfig(type="local-test"), primary.view)
        assert isinstance(tier, LocalTier)
    finally:
        unregister_tier("local-test")
    with pytest.raises(UnknownTierType):
        get_tier_class("local-test")


def test_register_rejects_non_tiers() -> None:
    with pytest.raises(PluginImportError):
        register_tier(int)  # type: ignore[arg-type]


def test_tier_rejects_a_config_of_another_type() -> None:
    from tierkv.tier import TierConfig

    primary = PrimaryTier(2, 64, pin_memory=False)
    with pytest.raises(TypeError, match="MemoryTier needs a MemoryTierConfig"):
        MemoryTier(TierConfig(type="memory"), primary.view)


def test_a_missing_first_party_tier_says_how_to_install_it_from_the_checkout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tierkv.registry

    monkeypatch.setattr(tierkv.registry, "_entry_points", dict)  # nothing installed
    with pytest.raises(UnknownTierType) as err:
        get_tier_class("nvme")
    assert (
        "`pip install -e tiers/nvme (in a tierkv checkout: the distribution "
        "tierkv-cache-nvme)` provides it" in str(err.value)
    )
