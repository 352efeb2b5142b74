"""Fixtures for the nvme tier tests: a primary slab and nvme tiers on a real directory,
and a fault injector for the few errors a test machine cannot produce on demand.

Every test that takes `rig` runs once per I/O engine (`io_engine`): the Python path,
the compiled core's batch calls, and its per-block calls (`native-blocks`: what keys
over 100 bytes and primaries without one geometry take), so each stays tested. A test
that hooks the Python path's own functions (`blockfile`, `os.*` in worker threads) is
marked `python_io` and runs on it only; so do the tests of the fault injector. The
native runs are skipped when the core is not built, except under CI=true, where that
fails them (CI builds the core: it needs only the image's C compiler)."""

from __future__ import annotations

import errno
import itertools
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tierkv_nvme import NvmeTier, NvmeTierConfig, disk_footprint, native

from tierkv.contract.framing import header_bytes
from tierkv.contract.jobs import JobMetadata, JobResult
from tierkv.contract.keys import OffloadKey
from tierkv.primary import PrimaryTier
from tierkv.testing import random_keys

KEY_BYTES = 20  # what tierkv.testing.random_keys makes: a 16-byte hash + 4 group bytes
IO_ENGINES = ("python", "native", "native-blocks")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "python_io: hooks the Python I/O path's functions; runs on it only"
    )


def need_native() -> None:
    """Skip a test of the compiled core where it is not built; fail it under CI."""
    if not native.AVAILABLE:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {native.reason}")
        pytest.skip(native.reason)


@pytest.fixture(params=IO_ENGINES)
def io_engine(request: pytest.FixtureRequest) -> str:
    """The nvme tier's `io_engine` a test runs with (each test once per engine)."""
    engine: str = request.param
    if engine.startswith("native"):
        if request.node.get_closest_marker("python_io"):
            pytest.skip("hooks the Python I/O path")
        need_native()
    if engine == "native-blocks":  # the core, without its batch calls
        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setattr(native, "batch_ready", lambda dir_fd=-1: False)
        return "native"
    return engine


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Rig:
    """One primary slab and a factory of nvme tiers over it on one directory."""

    _job_ids = itertools.count(1)

    def __init__(
        self,
        path: Path,
        *,
        block_bytes: int = 4096,
        slots: int = 32,
        namespace: str = "nvme-test",
        io_engine: str = "python",
    ) -> None:
        self.path = path
        self.io_engine = io_engine
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
        fields.setdefault("io_engine", self.io_engine)
        fields.setdefault("layout", "files")  # the slab layout's own tests ask for it
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
def rig(tmp_path: Path, io_engine: str) -> Rig:
    return Rig(tmp_path / "nvme", io_engine=io_engine)


def run_until_killed(source: str, args: Sequence[str], delay: float, log: Path) -> None:
    """Run `python -c source *args` (a writer that prints "started" once its first job
    is stored, then writes until killed), let it write on for `delay` seconds after
    that line, SIGKILL it; its stderr goes to `log`."""
    with log.open("w") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-c", source, *args], stdout=subprocess.PIPE, stderr=errors, text=True
        )
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            line = proc.stdout.readline() if ready else ""
            assert line.strip() == "started", f"writer did not start: {log.read_text()}"
            time.sleep(delay)
            assert proc.poll() is None, f"writer exited early: {log.read_text()}"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture
def killed_writer() -> Callable[[str, Sequence[str], float, Path], None]:
    """`run_until_killed`, for the crash tests of both layouts."""
    return run_until_killed


@pytest.fixture
def make_rig() -> type[Rig]:
    """The Rig class, for a test that needs rigs of its own (other block sizes, two
    engines side by side)."""
    return Rig


@pytest.fixture
def native_core() -> None:
    """For a test of the compiled core: skipped where it is not built (failed under CI)."""
    need_native()


@pytest.fixture
def core(native_core: None) -> Any:
    """The compiled core's module (`tierkv_nvme._batchio`), for tests of its own entry
    points (its hashes)."""
    return native._core


def cut_at(data: bytes, cuts: list[int]) -> tuple[bytes, ...]:
    """`data` cut at `cuts` (positions, any order, repeats give empty parts)."""
    at = sorted(min(c, len(data)) for c in cuts)
    return tuple(data[a:b] for a, b in zip([0, *at], [*at, len(data)]))


@pytest.fixture
def split() -> Callable[[bytes, list[int]], tuple[bytes, ...]]:
    """`cut_at`, for tests of hashes that take their input in parts."""
    return cut_at


@pytest.fixture
def native_rig(tmp_path: Path, native_core: None) -> Rig:
    """A rig whose tiers use the compiled core."""
    return Rig(tmp_path / "nvme", io_engine="native")


class FaultInjector:
    """Makes chosen file system calls fail for files under one directory, as a full
    or read-only disk would; every other call goes to the real `os` function.

    Global while active (worker threads call `os.*`), so tests use it as a context
    manager around the few calls that should fail."""

    def __init__(
        self, root: Path, monkeypatch: pytest.MonkeyPatch, io_engine: str = "python"
    ) -> None:
        self.root = str(root.resolve())
        self.monkeypatch = monkeypatch
        self.io_engine = io_engine
        self.hits = 0
        self._lock = threading.Lock()

    def _under_root(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.root)
        except OSError:
            return False

    def _python_only(self) -> None:
        """The faults are injected into Python's `os` calls: the compiled core makes
        its own system calls, so a test that injects one runs on the Python path only."""
        if self.io_engine != "python":
            pytest.skip("faults are injected into the Python I/O path's os calls")

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
        self._python_only()
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
        self._python_only()
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
        self._python_only()
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
    return FaultInjector(rig.path, monkeypatch, rig.io_engine)
