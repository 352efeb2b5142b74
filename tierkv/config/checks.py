"""Checks across the tiers of a chain, run on the tiers whose sections validated:
names unique and not the primary's, no two tiers in one directory."""

from __future__ import annotations

import os
from pathlib import Path

from tierkv.config.model import PRIMARY_NAME, tier_names
from tierkv.contract.tier import TierConfig


def name_problems(tiers: list[tuple[int, TierConfig]]) -> list[str]:
    """Tier names must be unique and leave `cpu` to the primary."""
    configs = [t for _, t in tiers]
    names = tier_names(configs)
    problems = []
    first: dict[str, int] = {}
    for (i, config), name in zip(tiers, names):
        where = f"tiers[{i}].name" if config.name is not None else f"tiers[{i}]"
        if name == PRIMARY_NAME:
            problems.append(f"{where}: {name!r} is the primary's name; choose another")
        elif name in first:
            problems.append(
                f"{where}: {name!r} is already the name of tiers[{first[name]}]; tier "
                "names must be unique (set `name:` on one of them)"
            )
        else:
            first[name] = i
    return problems


def path_problems(tiers: list[tuple[int, TierConfig]]) -> list[str]:
    """Two tiers that keep files may not share a directory (or nest one in another):
    each would take the other's files for its own."""
    seen: list[tuple[int, Path]] = []
    problems = []
    for i, config in tiers:
        raw = getattr(config, "path", None)
        if not isinstance(raw, (str, os.PathLike)):
            continue
        path = Path(os.path.abspath(os.path.expanduser(os.fspath(raw))))
        for j, other in seen:
            if path == other:
                problems.append(f"tiers[{i}].path: {str(path)!r} is also the path of tiers[{j}]")
            elif other in path.parents or path in other.parents:
                problems.append(
                    f"tiers[{i}].path: {str(path)!r} and tiers[{j}].path {str(other)!r} "
                    "nest; give each tier a directory of its own"
                )
        seen.append((i, path))
    return problems
