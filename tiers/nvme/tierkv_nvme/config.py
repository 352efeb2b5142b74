"""The `nvme` tier's YAML section.

    tiers:
      - {type: nvme, path: /mnt/nvme/tierkv, capacity: 500GiB, fsync: always}

Every field but `path` and `capacity` has a default; unknown fields are rejected
(inherited from `TierConfig`), so a typo such as `capactiy` is an error, not a
silently ignored line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from tierkv.contract.units import Size
from tierkv.tier import TierConfig

FsyncMode = Literal["always", "never"]
IoEngine = Literal["auto", "native", "python"]


class NvmeTierConfig(TierConfig):
    """Where the blocks live, how much disk they may take, and how hard to push the disk."""

    path: Path = Field(
        description="directory for the blocks; created if missing. Each namespace gets "
        "its own subdirectory, so several models may share one path"
    )
    capacity: Size = Field(
        gt=0,
        description="disk bytes this tier may fill (each block file counted rounded up "
        "to the filesystem block); past it the least recently used blocks are deleted",
    )
    eviction: Literal["lru"] = Field(
        default="lru", description="which blocks go first when the tier is full"
    )
    io_concurrency: int = Field(
        default=8,
        ge=1,
        le=256,
        description="worker-thread calls doing block I/O at once, across all jobs "
        "(each call reads or writes up to 2 MiB of small blocks of one job, at most 64, "
        "or up to 4 large ones)",
    )
    fsync: FsyncMode = Field(
        default="always",
        description="always: a block's bytes are on stable storage before it is renamed "
        "into place and its store reports ok; never: the kernel flushes when it likes. "
        "Either way a power loss costs at most recent blocks, which then read as misses "
        "(checksums and the rebuild on open see to that), never as wrong data",
    )
    io_engine: IoEngine = Field(
        default="auto",
        description="what moves the blocks' bytes: native, the compiled core (a whole "
        "batch per call, GIL released; built when the package is installed with a C "
        "compiler and libxxhash-dev); python, the pure-Python path; auto, native when "
        "it is built and the frames carry no MAC (mac_key_env), else python. The same "
        "files either way",
    )

    @field_validator("path", mode="before")
    @classmethod
    def _usable_path(cls, value: object) -> object:
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("path must name a directory, not an empty string")
            return Path(value).expanduser()
        return value
