"""Fixtures for the nvme tier tests: a primary slab and nvme tiers on a real directory,
and a fault injector for the few errors a test machine cannot produce on demand."""

from __future__ import annotations

import errno
import itertools
import os
import random
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tierkv_nvme import NvmeTier, NvmeTierConfig, disk_footprint

from tierkv.contract.framing import header_bytes
from tierkv.contract.jobs import JobMetadata, JobResult
from tierkv.contract.keys import OffloadKey
from tierkv.primary import PrimaryTier
from tierkv.testing import random_keys

KEY_BYTES = 20  # what tierkv.testing.random_keys makes: a 16-byte hash + 4 group bytes


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Rig:
    """One primary slab and a factory of nvme tiers over it on one directory."""

    _job_ids = itertools.count(1)

    def __init__(
        self, path: Path, *, block_bytes: int = 4096, slots: int = 32, namespace: str = "nvme-test"
    ) -> None:
        self.path = path
        self.primary = PrimaryTier(slots, block_bytes, pin_memory=False, namespace=namespace)
        self.view = self.primary.view
        self.rng = random.Random(0)

    @property
    def block_bytes(self) -> int:
        return self.view.block_bytes

    def footprint(self, fs_block: int = 4096) -> int:
        return disk_footprint(header_bytes(b"k" * KEY_BYTES) + self.block_bytes, fs_block)

    def tier(self, capacity_blocks: int = 1024, **fields: Any) -> NvmeTier:
        fields.setdefault("capacity", capacity_blocks * self.footprint())
        config = NvmeTierConfig(type="nvme", path=self.path, **fields)
        return NvmeTier(config, self.view)

    def keys(self, n: int) -> list[OffloadKey]:
        return random_keys(n, self.rng)

    def job(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> JobMetadata:
        return JobMetadata(next(self._job_ids), tuple(keys), tuple(slots))

    def fill(self, slots: Sequence[int]) -> list[bytes]:
        data = [self.rng.randbytes(self.block_bytes) for _ in slots]
        for slot, payload in zip(slots, data):
            self.view.block(slot)[:] = payload
        return data

    async def store(
        self, tier: NvmeTier, keys: Sequence[OffloadKey], first_slot: int = 0
    ) -> tuple[JobResult, dict[OffloadKey, bytes]]:
        slots = list(range(first_slot, first_slot + len(keys)))
        data = self.fill(slots)
        result = await tier.store(self.job(keys, slots))
        return result, dict(zip(keys, data))

    async def load(
        self, tier: NvmeTier, keys: Sequence[OffloadKey], first_slot: int = 16
    ) -> tuple[JobResult, dict[OffloadKey, bytes]]:
        slots = list(range(first_slot, first_slot + len(keys)))
        for slot in slots:
            self.view.block(slot)[:] = bytes(self.block_bytes)
        result = await tier.load(self.job(keys, slots))
        return result, {k: bytes(self.view.block(s)) for k, s in zip(keys, slots)}

    def files(self, tier: NvmeTier, suffix: str = "") -> list[Path]:
        """Every file in the tier's fan-out directories (not the lock or the note)."""
        return sorted(
            p for p in tier.directory.glob("*/*") if p.is_file() and p.name.endswith(suffix)
        )


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path / "nvme")


class FaultInjector:
    """Makes chosen file system calls fail for files under one directory, as a full
    or read-only disk would; every other call goes to the real `os` function.

    Global while active (worker threads call `os.*`), so tests use it as a context
    manager around the few calls that should fail."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = str(root.resolve())
        self.monkeypatch = monkeypatch
        self.hits = 0
        self._lock = threading.Lock()

    def _under_root(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.root)
        except OSError:
            return False

    def _hit(self) -> None:
        with self._lock:
            self.hits += 1

    def _used_under_root(self) -> int:
        """Bytes the files under root take, each rounded up to a 4 KiB page (as tmpfs
        counts them)."""
        used = 0
        for folder, _dirs, names in os.walk(self.root):
            for name in names:
                try:
                    size = os.stat(os.path.join(folder, name)).st_size
                except FileNotFoundError:
                    continue
                used += -(-size // 4096) * 4096
        return used

    @contextmanager
    def disk_of(self, size: int) -> Iterator[None]:
        """Writes under root behave as on a filesystem of `size` bytes: the write that
        crosses it stores part of its bytes, the next one fails with ENOSPC; deleting
        files makes room again."""
        real_writev = os.writev

        def writev(fd: int, buffers: Sequence[Any]) -> int:
            if not self._under_root(fd):
                return real_writev(fd, buffers)
            with self._lock:
                offset = os.lseek(fd, 0, os.SEEK_CUR)
                grown = -(-offset // 4096) * 4096 - offset  # free bytes in the last page
                room = max(0, size - self._used_under_root()) + grown
                wanted = sum(memoryview(b).nbytes for b in buffers)
                if room <= 0:
                    self.hits += 1
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                if wanted <= room:
                    return real_writev(fd, buffers)
                flat = b"".join(bytes(b) for b in buffers)[:room]
                return os.write(fd, flat)

        with self.monkeypatch.context() as m:
            m.setattr(os, "writev", writev)
            yield

    @contextmanager
    def fail_create(self, code: int) -> Iterator[None]:
        """Creating a file under root fails with `code` (EACCES, EROFS, ...)."""
        real_open = os.open

        def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            dir_fd = kwargs.get("dir_fd")
            base = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) if dir_fd is not None else None
            full = base / path if base is not None else Path(path).resolve()
            if flags & os.O_CREAT and str(full).startswith(self.root):
                self._hit()
                raise OSError(code, os.strerror(code), str(path))
            return real_open(path, flags, *args, **kwargs)

        with self.monkeypatch.context() as m:
            m.setattr(os, "open", fake_open)
            yield

    @contextmanager
    def fail_read(self, code: int) -> Iterator[None]:
        """Reading a block file under root fails with `code` (EIO, ...)."""
        real_preadv = os.preadv

        def preadv(fd: int, buffers: Sequence[Any], offset: int, *args: Any) -> int:
            if self._under_root(fd):
                self._hit()
                raise OSError(code, os.strerror(code))
            return real_preadv(fd, buffers, offset, *args)

        with self.monkeypatch.context() as m:
            m.setattr(os, "preadv", preadv)
            yield


@pytest.fixture
def faults(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> FaultInjector:
    rig.path.mkdir(parents=True, exist_ok=True)
    return FaultInjector(rig.path, monkeypatch)
