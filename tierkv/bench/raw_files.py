"""`nvme`'s raw media: one big file at block offsets (`RawFile`), and one file per
block as the tier keeps them (`RawBlockFiles`, the streaming phase's baseline); both
read the disk, not the page cache, on a load (`drop_page_cache`)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch

from tierkv.bench.raw import RawMedium
from tierkv.bench.timing import Batch
from tierkv.contract.tier import SecondaryTierManager


def drop_page_cache(paths: Sequence[Path]) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


class RawFile(RawMedium):
    """`nvme`'s medium: one file, `os.pwrite`/`os.preadv` at block offsets in worker
    threads, the tier's `io_concurrency` at a time; `fdatasync` after each block when
    the tier has `fsync: always` (the durability the tier gives each block)."""

    def __init__(self, tier: Any, block_bytes: int) -> None:  # an NvmeTierConfig
        super().__init__(int(getattr(tier, "io_concurrency", 8)))
        self.fsync = getattr(tier, "fsync", "always") == "always"
        self.block_bytes = block_bytes
        self.description = f"os.pwrite/os.pread, {self.width} threads" + (
            ", fdatasync per block" if self.fsync else ""
        )
        self.directory = Path(str(tier.path))
        self.path = self.directory / f".tierkv-bench-raw-{os.getpid()}"
        self.fd = -1

    async def open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

    def _write(self, row: memoryview, offset: int) -> None:
        os.pwrite(self.fd, row, offset)
        if self.fsync:
            os.fdatasync(self.fd)

    def _read(self, row: memoryview, offset: int) -> None:
        if os.preadv(self.fd, [row], offset) != len(row):
            raise OSError(f"short read at offset {offset} of {self.path}")

    async def put(self, i: int, row: memoryview) -> None:
        await anyio.to_thread.run_sync(self._write, row, i * self.block_bytes)

    async def get(self, i: int, row: memoryview) -> None:
        await anyio.to_thread.run_sync(self._read, row, i * self.block_bytes)

    async def before_load(self, tier: SecondaryTierManager | None) -> None:
        if tier is None:
            paths = [self.path]
        else:  # the nvme tier's directory for this namespace
            root = Path(str(getattr(tier, "directory", self.directory)))
            paths = [p for p in root.rglob("*") if p.is_file()]
        await anyio.to_thread.run_sync(drop_page_cache, paths)

    async def cleanup(self, n: int) -> None:
        os.ftruncate(self.fd, 0)

    async def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)


class RawBlockFiles(RawFile):
    """`nvme`'s medium as the tier uses it: one file per block, all in one directory.
    A store opens each file (`O_CREAT | O_TRUNC`), `os.pwrite`s the block, `fdatasync`s
    it when the tier has `fsync: always`, and closes it; a load opens, `os.preadv`s
    and closes. Worker threads, the tier's `io_concurrency` at a time, one block per
    thread call. What the tier adds on top: the frame header and its checksum (and
    MAC), the temporary name and rename, the fan-out directories walked without
    following links, and its index.

    The streaming phase's honest baseline: against one big file (`RawFile`) a
    file-per-block store also pays a file creation and, with fsync, a journal commit
    per block; a load an open per block. Both are reported."""

    def __init__(self, tier: Any, block_bytes: int) -> None:  # an NvmeTierConfig
        super().__init__(tier, block_bytes)
        self.description = (
            f"one file per block: open/os.pwrite{'/fdatasync' if self.fsync else ''}/close "
            f"and open/os.preadv/close, {self.width} threads"
        )
        self.blocks_dir = self.directory / f".tierkv-bench-raw-files-{os.getpid()}"
        self.written = 0

    def _file(self, offset: int) -> str:
        return str(self.blocks_dir / f"{offset // self.block_bytes}.blk")

    async def open(self) -> None:
        self.blocks_dir.mkdir(parents=True, exist_ok=True)

    def _write(self, row: memoryview, offset: int) -> None:
        fd = os.open(self._file(offset), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = row.cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
            if self.fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _read(self, row: memoryview, offset: int) -> None:
        fd = os.open(self._file(offset), os.O_RDONLY)
        try:
            if os.preadv(fd, [row], 0) != len(row):
                raise OSError(f"short read of {self._file(offset)}")
        finally:
            os.close(fd)

    async def store(self, data: torch.Tensor, batch: Batch) -> None:
        await super().store(data, batch)
        self.written = max(self.written, batch[1])

    async def before_load(self, tier: SecondaryTierManager | None) -> None:
        if tier is None:
            paths = [Path(self._file(i * self.block_bytes)) for i in range(self.written)]
            await anyio.to_thread.run_sync(drop_page_cache, paths)
        else:
            await super().before_load(tier)

    async def cleanup(self, n: int) -> None:
        def delete() -> None:
            for i in range(max(n, self.written)):
                Path(self._file(i * self.block_bytes)).unlink(missing_ok=True)

        await anyio.to_thread.run_sync(delete)
        self.written = 0

    async def close(self) -> None:
        await self.cleanup(self.written)
        with contextlib.suppress(OSError):
            self.blocks_dir.rmdir()


class NativeReference:
    """The native reference row: the same number of block files written and read by
    plain C (open + pwrite|pread + close each, no frame, no checksum) on `threads`
    threads, in a directory beside the tier's, read cold as the tier's loads are.
    The loop is the nvme tier's compiled core's (`tierkv_nvme.reference`), imported by
    name so the core bench needs no plugin; `reason` says why there is no row when
    the plugin or its core is missing."""

    def __init__(self, tier: Any, block_bytes: int, threads: int) -> None:  # NvmeTierConfig
        self.block_bytes = block_bytes
        self.threads = threads
        self.fsync = getattr(tier, "fsync", "always") == "always"
        self.directory = Path(str(tier.path)) / f".tierkv-bench-native-{os.getpid()}"
        sync = "/fdatasync" if self.fsync else ""
        self.description = (
            f"plain C, one file per block: open/pwrite{sync}/close and open/pread/close, "
            f"{threads} threads, no frame or checksum (the nvme core's reference loop)"
        )
        self.reason = ""
        try:
            module = importlib.import_module("tierkv_nvme.reference")
        except ImportError as exc:
            self._run = None
            self.reason = f"the nvme tier's package is not importable ({exc})"
            return
        ready, why = module.available()
        self._run = module.run_reference if ready else None
        if not ready:
            self.reason = why

    @property
    def available(self) -> bool:
        return self._run is not None

    async def run(self, blocks: int) -> tuple[tuple[float, float], tuple[float, float]]:
        """((write seconds, CPU seconds), (read seconds, CPU seconds)) of `blocks` files."""
        assert self._run is not None, self.reason
        write, read = await anyio.to_thread.run_sync(
            functools.partial(
                self._run,
                self.directory,
                blocks,
                self.block_bytes,
                self.threads,
                cold=True,
                fsync=self.fsync,
            )
        )
        return (write.seconds, write.cpu_seconds), (read.seconds, read.cpu_seconds)

