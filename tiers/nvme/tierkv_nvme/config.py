"""The `nvme` tier's YAML section.

    tiers:
      - {type: nvme, path: /mnt/nvme/tierkv, capacity: 500GiB, fsync: always}

or, to stripe the tier over several drives (`tierkv_nvme.striped`):

    tiers:
      - {type: nvme, paths: [/mnt/nvme0/tierkv, /mnt/nvme1/tierkv], capacity: 1TiB}

Every field but `path` (or `paths`) and `capacity` has a default (`layout: slab`:
blocks in the slots of a few files; `layout: files`: a file per block); unknown
fields are rejected (inherited from `TierConfig`), so a typo such as `capactiy` is an
error, not a silently ignored line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from tierkv.contract.units import Size
from tierkv.tier import TierConfig

FsyncMode = Literal["always", "never"]
IoEngine = Literal["auto", "native", "python"]
Layout = Literal["files", "slab"]


class NvmeTierConfig(TierConfig):
    """Where the blocks live, how much disk they may take, and how hard to push the disk."""

    path: Path = Field(
        description="directory for the blocks; created if missing. Each namespace gets "
        "its own subdirectory, so several models may share one path"
    )
    paths: list[Path] | None = Field(
        default=None,
        description="instead of `path`: several directories, one per drive, serving as "
        "one tier; blocks are spread over them by key hash, and each directory has its "
        "own `io_concurrency` and an even share of `capacity`",
    )
    capacity: Size = Field(
        gt=0,
        description="disk bytes this tier may fill (slab: a slot per block, the block "
        "rounded up to 4 KiB plus a 4 KiB header page; files: each block file counted "
        "rounded up to the filesystem block); past it the least recently used blocks go. "
        "With `paths`, the whole tier's: each directory takes an even share",
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
        "or up to 4 large ones); with `paths`, per directory",
    )
    fsync: FsyncMode = Field(
        default="always",
        description="always: a block's bytes are on stable storage before its store "
        "reports ok (slab: one fdatasync per file a chunk wrote; files: per file, before "
        "it is renamed into place); never: the kernel flushes when it likes. "
        "Either way a power loss costs at most recent blocks, which then read as misses "
        "(checksums and the rebuild on open see to that), never as wrong data",
    )
    layout: Layout = Field(
        default="slab",
        description="how blocks lie on the disk: slab, fixed slots of 8 sparse files per "
        "namespace written in place (no file created or deleted per block; `capacity` "
        "becomes a slot count); files, one checksummed file per block named by its key "
        "(earlier versions' layout: a directory of them is moved into slots when opened "
        "as slab). docs/data-path.md compares them",
    )
    io_engine: IoEngine = Field(
        default="auto",
        description="what moves the blocks' bytes: native, the compiled core (a whole "
        "batch per call, GIL released; built when the package is installed with a C "
        "compiler; it signs and checks frames itself with mac_key_env); "
        "python, the pure-Python path; auto, native when it is built, else python. The "
        "same files either way",
    )
    direct: bool = Field(
        default=False,
        description="O_DIRECT for the slab slots' payload and header I/O, bypassing the "
        "page cache (the disk's bandwidth without the copy into the cache, and the "
        "cache left to others; a load is never served from memory). Only with "
        "`layout: slab` and the native core (io_engine auto or native); where a block's "
        "memory is not 4 KiB aligned (start, length) it is moved buffered, as are all "
        "blocks where the filesystem refuses O_DIRECT. The tier's data path says which",
    )

    @model_validator(mode="before")
    @classmethod
    def _path_or_paths(cls, data: Any) -> Any:
        """Exactly one of `path` and `paths`. With `paths`, `path` is its first entry,
        so code that knows one directory (a plain `NvmeTier`, which `paths` of one
        entry makes) finds it there."""
        if not isinstance(data, dict) or data.get("paths") is None:
            return data  # no `paths`: `path` is required as it always was
        if data.get("path") is not None:
            raise ValueError(
                "give `path` (one directory) or `paths` (several, one per drive), not both"
            )
        paths = data["paths"]
        first = paths[0] if isinstance(paths, (list, tuple)) and paths else None
        usable = isinstance(first, os.PathLike) or (isinstance(first, str) and first.strip())
        # an unusable `paths` fails on its own field; `.` only keeps `path` from adding
        # a second, misleading error ("is required") to that one
        return {**data, "path": first if usable else "."}

    @model_validator(mode="after")
    def _direct_where_it_works(self) -> NvmeTierConfig:
        """`direct` is the slab's and the compiled core's: refuse it elsewhere rather
        than ignore it, naming the fix."""
        if self.direct and self.layout != "slab":
            raise ValueError(
                "direct: true moves the slab layout's slots; with layout: files it would "
                "do nothing: set layout: slab, or direct: false"
            )
        if self.direct and self.io_engine == "python":
            raise ValueError(
                "direct: true needs the compiled core, which io_engine: python turns off: "
                "set io_engine: auto (or native), or direct: false"
            )
        return self

    @field_validator("path", mode="before")
    @classmethod
    def _usable_path(cls, value: object) -> object:
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("path must name a directory, not an empty string")
            return Path(value).expanduser()
        return value

    @field_validator("paths", mode="before")
    @classmethod
    def _usable_paths(cls, value: object) -> object:
        if not isinstance(value, (list, tuple)):
            return value  # pydantic says it is not a list
        if not value:
            raise ValueError("paths must name at least one directory (one per drive)")
        expanded: list[object] = []
        for i, entry in enumerate(value):
            if isinstance(entry, str):
                if not entry.strip():
                    raise ValueError(f"entry {i} is an empty string; name a directory")
                entry = Path(entry)
            expanded.append(entry.expanduser() if isinstance(entry, Path) else entry)
        return expanded

    @field_validator("paths")
    @classmethod
    def _distinct_paths(cls, value: list[Path] | None) -> list[Path] | None:
        """No directory twice, and none inside another: each directory's tier takes
        its whole namespace directory for its own."""
        if value is None:
            return value
        seen: list[Path] = []
        for entry in value:
            where = Path(os.path.normpath(os.path.abspath(entry)))
            for other in seen:
                if where == other:
                    raise ValueError(f"{str(entry)!r} is listed twice; give each drive once")
                if other in where.parents or where in other.parents:
                    raise ValueError(
                        f"{str(entry)!r} and {str(other)!r} nest; give each drive a "
                        "directory of its own (normally one per mount point)"
                    )
            seen.append(where)
        return value

    @model_serializer(mode="wrap")
    def _dump_as_written(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> Any:
        """A dump holds `paths` or `path`, as the YAML did, so it validates again."""
        data = handler(self)
        if self.paths is not None and isinstance(data, dict):
            data.pop("path", None)
        return data

    def directories(self) -> list[Path]:
        """Every directory the tier keeps blocks in: `paths`, or `[path]`."""
        return list(self.paths) if self.paths is not None else [self.path]
