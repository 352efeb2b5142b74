"""Where `tierkv bench --config` writes: a fresh temporary directory under each of the
chain's paths, removed when the bench ends.

The bench must measure the disks the chain names (an nvme tier's directory is the
drive it will use), but must not fill the paths a server uses: each run would leave
its namespace's directory tree behind, and a raw baseline's files on an error. So
every path of every tier (`tierkv.demo.scratch.path_fields`) moves into a new
`.tierkv-bench-*` directory made in that path (a directory), or beside it (a file, or
a directory that does not exist yet: in its nearest existing parent, on the same
filesystem), and the whole directory is removed afterwards, errors and Ctrl-C
included. A path where nothing can be created fails before anything is measured,
with one line naming the tier, the directory and the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tierkv.config import CacheConfig
from tierkv.config.machine import nearest_existing
from tierkv.contract.errors import TierUnavailable
from tierkv.contract.tier import TierConfig
from tierkv.demo.scratch import path_fields, with_paths

PREFIX = ".tierkv-bench-"
MEASURES = "tierkv bench measures the tier's disk"


def scratch_home(path: Path) -> Path:
    """The directory a bench's temporary directory for `path` goes in: `path` itself
    when it is a directory, else its nearest existing parent."""
    path = Path(os.path.abspath(os.path.expanduser(path)))
    return path if path.is_dir() else nearest_existing(path.parent)


def make_scratch(tier: str, field: str, path: Path, purpose: str, *, prefix: str = PREFIX) -> Path:
    """A new `<prefix>*` directory in `scratch_home(path)`; `TierUnavailable`
    naming `tier`, its `field`, the directory and the reason when none can be made
    there (a read-only or immutable directory, a file in the way). `purpose` says
    what it is for: "tierkv bench measures the tier's disk"."""
    home = scratch_home(path)
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=home))
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise TierUnavailable(
            f"tier {tier}: cannot create a directory in {home} ({reason}); {purpose} in a "
            f"temporary directory there (its `{field}`), removed afterwards. Make it "
            "writable for this user, or point the tier at a writable directory"
        ) from None


@contextlib.contextmanager
def in_bench_scratch(config: CacheConfig) -> Iterator[CacheConfig]:
    """`config` with every tier's paths inside fresh temporary directories made under
    them (`scratch_home`), removed on the way out."""
    made: list[Path] = []
    try:
        tiers: list[TierConfig] = []
        for name, tier in zip(config.tier_names(), config.tiers):
            moved: dict[str, Path] = {}
            for field, old in path_fields(tier).items():  # `path`, or `paths[i]` each
                scratch = make_scratch(name, field, old, MEASURES)
                made.append(scratch)
                moved[field] = scratch / (old.name or field)
            tiers.append(with_paths(tier, moved) if moved else tier)
        yield config.model_copy(update={"tiers": tiers})
    finally:
        for scratch in made:
            shutil.rmtree(scratch, ignore_errors=True)
