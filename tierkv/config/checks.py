"""Checks across the tiers of a chain, run on the tiers whose sections validated:
names unique and not the primary's, no two tiers in one directory (every directory
of a tier with several counts); and, against this machine, no tier directory other
users can write (`privacy_problems`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tierkv.config.machine import tier_directories
from tierkv.config.model import PRIMARY_NAME, tier_names
from tierkv.contract.private import directory_problem
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
    each would take the other's files for its own. Every directory of a tier counts:
    its `path`, or each entry of its `paths` (a tier striped over several drives;
    that its own entries are distinct is its config's check)."""
    seen: list[tuple[int, str, Path]] = []
    problems = []
    for i, config in tiers:
        mine = [(label, Path(os.path.abspath(path))) for label, path in tier_directories(config)]
        for label, path in mine:
            for j, other_label, other in seen:
                if path == other:
                    problems.append(
                        f"tiers[{i}].{label}: {str(path)!r} is also "
                        + (
                            f"the path of tiers[{j}]"
                            if other_label == "path"
                            else f"tiers[{j}].{other_label}"
                        )
                    )
                elif other in path.parents or path in other.parents:
                    problems.append(
                        f"tiers[{i}].{label}: {str(path)!r} and tiers[{j}].{other_label} "
                        f"{str(other)!r} nest; give each tier a directory of its own"
                    )
        seen += [(i, label, path) for label, path in mine]
    return problems


def privacy_problems(tiers: list[tuple[int, TierConfig]]) -> list[str]:
    """Every existing directory a tier names (`path`, or each of `paths`) must be no
    other user's to write (`tierkv.contract.private`): the nvme tier refuses one at
    `open`. Judged for the user this runs as (run `tierkv validate` as the server's
    user); a directory not there yet is made private by the tier, and a `path` that
    names a file (sqlite's database) is not a directory to judge. The namespace
    directory inside is judged at `open` only (its name is the tier's)."""
    problems = []
    for i, config in tiers:
        for label, path in tier_directories(config):
            try:
                st = os.stat(path)
            except OSError:
                continue  # missing (the tier makes it, 0700) or unreadable: open says
            if not stat.S_ISDIR(st.st_mode):
                continue
            problem = directory_problem(path, st)
            if problem is not None:
                problems.append(f"tiers[{i}].{label}: {problem}")
    return problems
