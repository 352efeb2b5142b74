"""Sizes in a config checked against the machine that will run it.

A primary larger than the machine's memory dies in the allocator, an nvme tier larger
than its disk fills the disk and fails writes for everyone; both are configuration
mistakes that `tierkv validate` (and every command that loads a chain) reports up
front, with the path, the size asked for and what the machine has:
`parse_config(..., check_machine=True)` runs these checks beside the structural ones,
on every field that parsed, so one run lists both kinds of problem.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tierkv.contract.tier import TierConfig
from tierkv.contract.units import approx_size, format_size

if TYPE_CHECKING:
    # the model's own module, not the `tierkv.config` package: the package imports
    # `loading`, which imports this module (an import circle, even if for types only)
    from tierkv.config.model import CacheConfig


def physical_memory() -> int | None:
    """Bytes of physical memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (a tier creates its directory)."""
    path = Path(os.path.abspath(os.path.expanduser(path)))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def filesystem_size(path: Path) -> tuple[int, int] | None:
    """(total bytes, device id) of the filesystem that holds `path` or would hold it."""
    where = nearest_existing(path)
    try:
        st = os.statvfs(where)
        device = os.stat(where).st_dev
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, device


def tier_directories(tier: TierConfig) -> list[tuple[str, Path]]:
    """The directories (or files) a tier keeps its data in, each with the YAML field
    that names it: every entry of a list field `paths` (`paths[0]`, `paths[1]`, ...;
    nvme's drives, for a tier striped over several) when the tier has one, else its
    field `path`; none for a tier with neither. `~` is expanded."""
    many = getattr(tier, "paths", None)
    if (
        isinstance(many, (list, tuple))
        and many
        and all(isinstance(p, (str, os.PathLike)) for p in many)
    ):
        return [(f"paths[{k}]", Path(os.path.expanduser(os.fspath(p)))) for k, p in enumerate(many)]
    one = getattr(tier, "path", None)
    if isinstance(one, (str, os.PathLike)):
        return [("path", Path(os.path.expanduser(os.fspath(one))))]
    return []


def _human(n: int) -> str:
    """Approximate above a MiB (`1.5GiB`), exact below (`512KiB`)."""
    return approx_size(n) if n >= 2**20 else format_size(n)


def machine_problems(config: CacheConfig, *, memory: int | None = None) -> list[str]:
    """What in `config` cannot fit this machine, one line per problem, by YAML path:
    the primary (and in-process memory tiers) against physical memory, every tier with
    a `path` and a `capacity` against the size of the filesystem under that path (the
    nearest existing parent when the path does not exist yet), several such tiers on
    one filesystem against it together. A tier with `paths` (several directories, one
    per drive) puts an even share of its capacity in each: each filesystem is checked
    against the shares of the directories on it (`tier_directories`)."""
    return fit_problems(int(config.primary.capacity), list(enumerate(config.tiers)), memory=memory)


def fit_problems(
    primary_capacity: int | None,
    tiers: Sequence[tuple[int, TierConfig]],
    *,
    memory: int | None = None,
) -> list[str]:
    """`machine_problems` over what of a config parsed: the primary's capacity (None
    when the primary section itself is invalid) and the tiers whose sections validated,
    each with its index in the YAML list. A config with structural errors is checked
    this way too, so both kinds of problem are reported at once; a size that did not
    parse cannot be checked until it does."""
    problems: list[str] = []
    memory = physical_memory() if memory is None else memory
    if memory:
        if primary_capacity is not None and primary_capacity > memory:
            problems.append(
                f"primary.capacity: {format_size(primary_capacity)} is more than this "
                f"machine's memory ({_human(memory)}); the slab could not be allocated"
            )
        for i, tier in tiers:
            capacity = getattr(tier, "capacity", None)
            if tier.type == "memory" and capacity is not None and int(capacity) > memory:
                problems.append(
                    f"tiers[{i}].capacity: {format_size(int(capacity))} is more than this "
                    f"machine's memory ({_human(memory)})"
                )
    # per filesystem: (tier index, its paths, of them on this filesystem, bytes) of
    # each tier with files on it, and its size
    on_device: dict[int, tuple[list[tuple[int, int, int, int]], int]] = {}
    for i, tier in tiers:
        capacity = getattr(tier, "capacity", None)
        directories = tier_directories(tier)
        if tier.type == "memory" or not directories or not capacity:
            continue
        capacity, n = int(capacity), len(directories)
        # a tier of several directories gives each an even share of its capacity; two
        # of them on one filesystem share it, so their shares add up
        found: dict[int, tuple[int, list[tuple[str, Path]]]] = {}
        for label, path in directories:
            fs = filesystem_size(path)
            if fs is not None:
                found.setdefault(fs[1], (fs[0], []))[1].append((label, path))
        for device, (size, here) in found.items():
            k = len(here)
            if capacity * k > size * n:
                where = str(nearest_existing(here[0][1]))
                if n == 1:
                    problems.append(
                        f"tiers[{i}].capacity: {format_size(capacity)} is more than the "
                        f"filesystem under {where!r} holds ({_human(size)} in all)"
                    )
                else:
                    labels = " + ".join(f"tiers[{i}].{label}" for label, _ in here)
                    share = "its share" if k == 1 else f"their {k} shares"
                    part = capacity * k // n
                    exact = format_size(part) if part * n == capacity * k else _human(part)
                    problems.append(
                        f"tiers[{i}].capacity: {format_size(capacity)} over {n} paths puts "
                        f"{exact} in {labels} ({share}), more than the "
                        f"filesystem under {where!r} holds ({_human(size)} in all)"
                    )
            else:
                on_device.setdefault(device, ([], size))[0].append((i, n, k, capacity))
    for entries, size in on_device.values():
        total = sum(capacity * k // n for _, n, k, capacity in entries)
        if len(entries) > 1 and total > size:
            names = " + ".join(
                f"tiers[{i}].capacity" if k == n else f"{k}/{n} of tiers[{i}].capacity"
                for i, n, k, _ in entries
            )
            problems.append(
                f"{names}: {_human(total)} together is more than their shared filesystem "
                f"holds ({_human(size)})"
            )
    return problems
