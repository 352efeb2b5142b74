"""The native reference: the same block files in plain C, measured in the same run.

Why: a tier's speed means little alone. `tierkv bench` and `benchmarks/nvme_engines.py`
print, beside the nvme tier, what a per-block loop of plain C reaches on the same
filesystem at the same moment: N files of B bytes under `xx/` fan-out directories,
one open + pwrite|pread + close per file, no frame, no checksum, T threads (the
project's `../shared/tools/rawio.c` does the same from a shell). The loop is the
compiled core's own (`_batchio.reference`), so no compiler is needed at bench time;
without the core there is no reference row, and the bench says why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tierkv_nvme import native

FANOUT = 256


@dataclass(frozen=True)
class ReferenceRun:
    """One pass of the reference: GB/s (decimal) and CPU µs per block (the process's
    user + system time over the blocks: run it while nothing else runs)."""

    op: str
    blocks: int
    block_bytes: int
    threads: int
    seconds: float
    cpu_seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.blocks * self.block_bytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def cpu_us_per_block(self) -> float:
        return self.cpu_seconds / self.blocks * 1e6 if self.blocks else 0.0


def available() -> tuple[bool, str]:
    """Whether the reference can run here, and why not."""
    return native.AVAILABLE, native.reason


def drop_cached(directory: Path, blocks: int) -> None:
    """Push the reference's files out of the page cache (a cold read, as the tier's
    loads get in the bench)."""
    for i in range(blocks):
        try:
            fd = os.open(directory / f"{i & 0xFF:02x}" / f"{i}.blk", os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def run_reference(
    directory: Path,
    blocks: int,
    block_bytes: int,
    threads: int,
    *,
    cold: bool = False,
    fsync: bool = False,
) -> tuple[ReferenceRun, ReferenceRun]:
    """Write then read `blocks` files of `block_bytes` under `directory` (made, then
    removed with everything in it) on `threads` threads: (write, read). With `fsync`,
    each file is fdatasync'ed before it is closed (as a tier with `fsync: always`
    does); with `cold`, the files leave the page cache between the write and the
    read. Raises RuntimeError without the core, OSError from the filesystem."""
    core = native._core
    if core is None:
        raise RuntimeError(native.reason)
    directory.mkdir(mode=0o700, parents=True, exist_ok=False)
    try:
        for d in range(FANOUT):
            (directory / f"{d:02x}").mkdir(mode=0o700)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            write = ReferenceRun(
                "write",
                blocks,
                block_bytes,
                threads,
                *core.reference("write", fd, blocks, block_bytes, threads, fsync),
            )
            if cold:
                drop_cached(directory, blocks)
            read = ReferenceRun(
                "read",
                blocks,
                block_bytes,
                threads,
                *core.reference("read", fd, blocks, block_bytes, threads),
            )
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(directory)
    return write, read


__all__ = ["ReferenceRun", "available", "drop_cached", "run_reference"]
