"""Where the demo's tiers keep their files.

`tierkv demo --config chain.yaml` must not fill the paths a chain names for a server
(`~/.cache/tierkv/nvme`, a database file) and must not start from what an earlier run
left there: two runs in a row report the same shares. So the demo moves every tier's
files into one fresh temporary directory, removed when the demo ends; `--keep` uses
the chain's own paths instead.

A tier config names a file or directory the way the tiers in this repository do: a
field holding a `Path` (nvme's and sqlite's `path`), or a string in a field called
`path` or ending in `_path`, `_dir` or `_file`; or several, in a list of them (nvme's
`paths`, one directory per drive: a list of `Path`s, or of strings in a field called
`paths` or ending in `_paths`, `_dirs` or `_files`), each entry moved on its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from tierkv.config import CacheConfig
from tierkv.contract.tier import TierConfig

PATH_SUFFIXES = ("_path", "_dir", "_file")
"""Field names taken as paths when their value is a string."""

LIST_SUFFIXES = ("_paths", "_dirs", "_files")
"""Field names taken as lists of paths when their value is a list of strings (as is
`paths`)."""

T = TypeVar("T", bound=TierConfig)


def _names_a_path(name: str, value: object) -> bool:
    named_like_a_path = name == "path" or name.endswith(PATH_SUFFIXES)
    return isinstance(value, os.PathLike) or (isinstance(value, str) and named_like_a_path)


def _names_paths(name: str, value: object) -> bool:
    if not isinstance(value, (list, tuple)) or not value:
        return False
    named_like_paths = name == "paths" or name.endswith(LIST_SUFFIXES)
    return all(
        isinstance(entry, os.PathLike) or (isinstance(entry, str) and named_like_paths)
        for entry in value
    )


def _entry(key: str) -> tuple[str, int | None]:
    """`paths[1]` -> (`paths`, 1); `path` -> (`path`, None)."""
    field, bracket, rest = key.partition("[")
    return (field, int(rest.rstrip("]"))) if bracket else (field, None)


def _mirror(field: str, values: Mapping[str, object]) -> str | None:
    """The field that repeats the first entry of list field `field` (nvme's `path`,
    `paths[0]` when `paths` is set), if `values` has one that does."""
    entries, single = values.get(field), field.removesuffix("s")
    if single == field or not isinstance(entries, (list, tuple)) or not entries:
        return None
    value = values.get(single)
    if not isinstance(value, (str, os.PathLike)) or not isinstance(entries[0], (str, os.PathLike)):
        return None
    return single if Path(value) == Path(entries[0]) else None


def path_fields(tier: TierConfig) -> dict[str, Path]:
    """The files and directories `tier` names, each keyed by where it is: a field's
    name (`path`, `index_file`), or for each entry of a list of them its field and
    index (`paths[0]`, `paths[1]`: nvme striped over several drives). A field that
    only repeats the first entry of its list (nvme's `path` beside `paths`) is left
    out: that entry names it. `with_paths` moves them."""
    values = {name: getattr(tier, name, None) for name in type(tier).model_fields}
    found: dict[str, Path] = {}
    mirrors = {_mirror(name, values) for name, value in values.items() if _names_paths(name, value)}
    for name, value in values.items():
        if _names_paths(name, value):
            assert isinstance(value, (list, tuple))
            found.update({f"{name}[{k}]": Path(entry) for k, entry in enumerate(value)})
        elif _names_a_path(name, value) and name not in mirrors:
            assert isinstance(value, (str, os.PathLike))
            found[name] = Path(value)
    return found


def moved_values(values: Mapping[str, object], moved: Mapping[str, Path]) -> dict[str, object]:
    """The field values that put the paths `moved` names (keys as `path_fields` gives
    them: `path`, `paths[1]`) where it says, given the fields' current `values` (a tier
    config's, or its YAML section): each keeps its kind (a `Path`, or a string), a list
    is copied with its entries replaced, and a field that repeated the first entry of
    a list (nvme's `path`) follows it. A key that names no path is a `KeyError`."""
    update: dict[str, object] = {}
    lists: dict[str, list[object]] = {}
    for key, new in moved.items():
        field, index = _entry(key)
        old = values.get(field)
        if index is None:
            if not isinstance(old, (str, os.PathLike)):
                raise KeyError(f"{key!r} names no path of this tier")
            update[field] = new if isinstance(old, os.PathLike) else str(new)
            continue
        if not isinstance(old, (list, tuple)) or not 0 <= index < len(old):
            raise KeyError(f"{key!r} names no path of this tier")
        entries = lists.setdefault(field, list(old))
        entries[index] = new if isinstance(old[index], os.PathLike) else str(new)
    for field, entries in lists.items():
        update[field] = tuple(entries) if isinstance(values[field], tuple) else entries
        single = _mirror(field, values)
        if single is not None and single not in moved:
            first = entries[0]
            assert isinstance(first, (str, os.PathLike))
            update[single] = Path(first) if isinstance(values[single], os.PathLike) else str(first)
    return update


def with_paths(tier: T, moved: Mapping[str, Path]) -> T:
    """`tier` with the paths `moved` names (keys as `path_fields` gives them) moved
    where it says (`moved_values`): with `paths`, `path` stays its first entry."""
    values = {name: getattr(tier, name, None) for name in type(tier).model_fields}
    return tier.model_copy(update=moved_values(values, moved))


def _dirname(key: str) -> str:
    """A directory name for a `path_fields` key: `paths[1]` -> `paths-1`."""
    field, index = _entry(key)
    return field if index is None else f"{field}-{index}"


def in_scratch(config: CacheConfig, root: Path) -> CacheConfig:
    """`config` with every tier's files under `root`: the field `path` of tier `nvme`
    becomes `root/nvme/<the path's last part>` (a directory stays a directory, a
    database file keeps its name); a tier with several such fields, or a list of them,
    gets `root/<tier>/<field>/<last part>` for each (`paths-0`, `paths-1`, ... for the
    entries of `paths`, `path` following the first). Tiers without paths are
    unchanged."""
    tiers: list[TierConfig] = []
    for i, (name, tier) in enumerate(zip(config.tier_names(), config.tiers)):
        fields = path_fields(tier)
        if not fields:
            tiers.append(tier)
            continue
        home = root / (name.strip(".") or f"tier{i}")
        moved: dict[str, Path] = {}
        for key, old in fields.items():
            new = home / _dirname(key) if len(fields) > 1 else home
            moved[key] = new / (old.name or _dirname(key))
        tiers.append(with_paths(tier, moved))
    return config.model_copy(update={"tiers": tiers})


def tier_paths(config: CacheConfig) -> dict[str, list[str]]:
    """Each tier's files or directories, by tier name (tiers without any left out)."""
    found = {
        name: [str(p) for p in path_fields(tier).values()]
        for name, tier in zip(config.tier_names(), config.tiers)
    }
    return {name: paths for name, paths in found.items() if paths}
