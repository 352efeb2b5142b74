"""Finds tier classes by type name, through the `tierkv.tiers` entry-point group.

Our own tiers register exactly as a third party does. Classes import lazily, on
first use; a type nobody installed, or a plugin that fails to import, gives an error
that says what is installed and what to `pip install`. Embedders and tests may also
`register_tier` a class directly.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import sys
from dataclasses import dataclass

from tierkv.contract.errors import PluginImportError, UnknownTierType
from tierkv.contract.slab import PrimaryView
from tierkv.contract.tier import SecondaryTierManager, TierConfig

ENTRY_POINT_GROUP = "tierkv.tiers"

KNOWN_TIER_PACKAGES: dict[str, str] = {
    "memory": "tierkv-cache",
    "nvme": "tierkv-cache-nvme",
    "redis": "tierkv-cache-redis",
    "s3": "tierkv-cache-s3",
    "mooncake": "tierkv-cache-mooncake",
}
"""Tier types we know of and the distribution that provides each, for error hints."""

CHECKOUT_PATHS: dict[str, str] = {
    "nvme": "tiers/nvme",
    "redis": "tiers/redis",
    "s3": "tiers/s3",
    "mooncake": "tiers/mooncake",
}
"""Where a first-party tier's distribution lives in a tierkv checkout (nothing is on the
package index yet, so that is where it installs from)."""


def install_hint(type_name: str) -> str | None:
    """How to install the distribution that provides `type_name`, if we know it."""
    dist = KNOWN_TIER_PACKAGES.get(type_name)
    if dist is None:
        return None
    path = CHECKOUT_PATHS.get(type_name)
    if path is None:
        return f"pip install {dist}"
    return f"pip install -e {path} (in a tierkv checkout: the distribution {dist})"


_registered: dict[str, type[SecondaryTierManager]] = {}


@dataclass(frozen=True)
class TierPluginInfo:
    """One installed tier type: where it comes from."""

    type: str
    target: str  # "module:Class"
    distribution: str | None
    version: str | None


_scan: tuple[tuple[str, ...], dict[str, list[md.EntryPoint]]] | None = None


def _entry_points() -> dict[str, list[md.EntryPoint]]:
    """Entry points of the group by name; two packages claiming one type both appear.

    Selected by group (`importlib.metadata.entry_points(group=...)` reads each
    distribution's entry_points.txt, not its METADATA) and scanned once per process:
    again only when `sys.path` changes or after `rescan()`."""
    global _scan
    key = tuple(sys.path)
    if _scan is None or _scan[0] != key:
        found: dict[str, list[md.EntryPoint]] = {}
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            found.setdefault(ep.name, []).append(ep)
        _scan = (key, found)
    return _scan[1]


def rescan() -> None:
    """Forget the entry points seen so far (after installing a plugin at run time)."""
    global _scan
    _scan = None


def _dist_of(ep: md.EntryPoint) -> tuple[str | None, str | None]:
    dist = ep.dist
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def installed_tiers() -> dict[str, TierPluginInfo]:
    """Every tier type available now, by type name (entry points and registered)."""
    infos: dict[str, TierPluginInfo] = {}
    for name, eps in _entry_points().items():
        dist, version = _dist_of(eps[0])
        infos[name] = TierPluginInfo(name, eps[0].value, dist, version)
    for name, cls in _registered.items():
        infos[name] = TierPluginInfo(name, f"{cls.__module__}:{cls.__qualname__}", None, None)
    return dict(sorted(infos.items()))


def register_tier(cls: type[SecondaryTierManager]) -> type[SecondaryTierManager]:
    """Make `cls` available under `cls.get_tier_type()` without an entry point.

    Usable as a class decorator. A registered class wins over an entry point of the
    same name."""
    _check_class(cls, cls.get_tier_type() if _is_tier_class(cls) else "?", f"{cls!r}")
    _registered[cls.get_tier_type()] = cls
    return cls


def unregister_tier(type_name: str) -> None:
    """Undo `register_tier` (tests use it to clean up)."""
    _registered.pop(type_name, None)


def _is_tier_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, SecondaryTierManager)


def _check_class(obj: object, type_name: str, origin: str) -> None:
    if not _is_tier_class(obj):
        raise PluginImportError(
            f"tier type {type_name!r} from {origin} is {obj!r}, "
            "not a subclass of tierkv.tier.SecondaryTierManager"
        )
    assert isinstance(obj, type) and issubclass(obj, SecondaryTierManager)
    declared = obj.get_tier_type()
    if declared != type_name:
        raise PluginImportError(
            f"tier type {type_name!r} from {origin} says its type is {declared!r}; "
            "the entry-point name and get_tier_type() must agree"
        )


def _unknown(type_name: str) -> UnknownTierType:
    names = list(installed_tiers())
    installed = ", ".join(names) or "none"
    others = [n for n in dict.fromkeys([*names, *KNOWN_TIER_PACKAGES]) if n != type_name]
    close = difflib.get_close_matches(type_name, others, n=1)
    if close:
        return UnknownTierType(
            f"unknown tier type {type_name!r}; did you mean {close[0]!r}? "
            f"installed tier types: {installed}"
        )
    hint = install_hint(type_name)
    fix = (
        f"`{hint}` provides it"
        if hint
        else "install the package that provides it (it registers an entry point in "
        f"the {ENTRY_POINT_GROUP!r} group)"
    )
    return UnknownTierType(
        f"unknown tier type {type_name!r}; installed tier types: {installed}. {fix}"
    )


def get_tier_class(type_name: str) -> type[SecondaryTierManager]:
    """The tier class registered as `type_name`, imported now if needed."""
    if type_name in _registered:
        return _registered[type_name]
    eps = _entry_points().get(type_name)
    if not eps:
        raise _unknown(type_name)
    if len({ep.value for ep in eps}) > 1:
        sources = "; ".join(f"{ep.value} ({_dist_of(ep)[0]})" for ep in eps)
        raise PluginImportError(
            f"tier type {type_name!r} is provided by more than one package: {sources}. "
            "Uninstall all but one."
        )
    ep = eps[0]
    dist, version = _dist_of(ep)
    origin = f"package {dist} {version}" if dist else f"entry point {ep.value}"
    try:
        obj = ep.load()
    except Exception as exc:  # a broken plugin must say so, not vanish
        raise PluginImportError(
            f"tier type {type_name!r} from {origin} ({ep.value}) failed to import: "
            f"{type(exc).__name__}: {exc}. Reinstall or fix that package."
        ) from exc
    _check_class(obj, type_name, origin)
    assert isinstance(obj, type) and issubclass(obj, SecondaryTierManager)
    return obj


def create_tier(config: TierConfig, primary: PrimaryView) -> SecondaryTierManager:
    """Instantiate the tier described by a validated `config` over `primary`."""
    cls = get_tier_class(config.type)
    return cls(config, primary)
