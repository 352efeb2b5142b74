"""Where the demo's tiers keep their files.

`tierkv demo --config chain.yaml` must not fill the paths a chain names for a server
(`~/.cache/tierkv/nvme`, a database file) and must not start from what an earlier run
left there: two runs in a row report the same shares. So the demo moves every tier's
files into one fresh temporary directory, removed when the demo ends; `--keep` uses
the chain's own paths instead.

A tier config names a file or directory the way the tiers in this repository do: a
field holding a `Path` (nvme's and sqlite's `path`), or a string in a field called
`path` or ending in `_path`, `_dir` or `_file`.
"""

from __future__ import annotations

import os
from pathlib import Path

from tierkv.config import CacheConfig
from tierkv.contract.tier import TierConfig

PATH_SUFFIXES = ("_path", "_dir", "_file")
"""Field names taken as paths when their value is a string."""


def path_fields(tier: TierConfig) -> dict[str, Path]:
    """The fields of `tier` that name a file or directory, with their values."""
    found: dict[str, Path] = {}
    for name in type(tier).model_fields:
        value = getattr(tier, name, None)
        named_like_a_path = name == "path" or name.endswith(PATH_SUFFIXES)
        if isinstance(value, os.PathLike) or (isinstance(value, str) and named_like_a_path):
            found[name] = Path(value)
    return found


def in_scratch(config: CacheConfig, root: Path) -> CacheConfig:
    """`config` with every tier's files under `root`: the field `path` of tier `nvme`
    becomes `root/nvme/<the path's last part>` (a directory stays a directory, a
    database file keeps its name); a tier with several such fields gets
    `root/<tier>/<field>/<last part>` for each. Tiers without paths are unchanged."""
    tiers: list[TierConfig] = []
    for i, (name, tier) in enumerate(zip(config.tier_names(), config.tiers)):
        fields = path_fields(tier)
        if not fields:
            tiers.append(tier)
            continue
        home = root / (name.strip(".") or f"tier{i}")
        update: dict[str, object] = {}
        for field, old in fields.items():
            new = home / field if len(fields) > 1 else home
            new = new / (old.name or field)
            update[field] = new if isinstance(getattr(tier, field), os.PathLike) else str(new)
        tiers.append(tier.model_copy(update=update))
    return config.model_copy(update={"tiers": tiers})


def tier_paths(config: CacheConfig) -> dict[str, list[str]]:
    """Each tier's files or directories, by tier name (tiers without any left out)."""
    found = {
        name: [str(p) for p in path_fields(tier).values()]
        for name, tier in zip(config.tier_names(), config.tiers)
    }
    return {name: paths for name, paths in found.items() if paths}
