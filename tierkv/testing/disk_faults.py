"""Real disk faults for tests: a disk that fills up and is freed again, a directory
tree made immutable and writable again.

Real, not injected: the nvme tier's data path may run in a compiled core that no
Python monkeypatch reaches, and a fault test should see what the kernel says
(ENOSPC, EPERM). Both need root (`mount`, `chattr`); where this machine does not
permit them, `DiskFaultUnavailable` says so and the caller skips.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DiskFaultUnavailable", "FullDisk", "immutable", "tiny_disk"]


class DiskFaultUnavailable(RuntimeError):
    """This machine does not permit the fault (not root, no tmpfs, no chattr)."""


@contextlib.contextmanager
def tiny_disk(where: Path, size: int) -> Iterator[FullDisk]:
    """A tmpfs of `size` bytes mounted at `where` (created) for the block; yields a
    `FullDisk` that fills it up and frees it on request. Unmounted at the end."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tierkv-test", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise DiskFaultUnavailable(f"cannot mount a tmpfs at {where}: {done.stderr.strip()}")
    try:
        yield FullDisk(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


class FullDisk:
    """The disk at `root`: `fill` takes every free byte with one file, `free` deletes it."""

    FILLER = ".tierkv-test-filler"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.filler = root / self.FILLER

    def fill(self) -> int:
        """Write zeros to the filler file until the disk says ENOSPC; bytes written."""
        written = 0
        chunk = b"\0" * (64 << 10)
        with open(self.filler, "ab", buffering=0) as out:
            while True:
                try:
                    n = out.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
                written += n or 0
                if not n:
                    break
        # smaller writes take the last partial page, so not even a header fits
        with contextlib.suppress(OSError), open(self.filler, "ab", buffering=0) as out:
            while out.write(b"\0" * 512):
                written += 512
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def free_bytes(self) -> int:
        stat = os.statvfs(self.root)
        return stat.f_bavail * stat.f_frsize


@contextlib.contextmanager
def immutable(root: Path) -> Iterator[None]:
    """Every directory under `root` (and `root`) immutable (`chattr +i`) for the block:
    no file can be created, renamed or deleted there (EPERM, for root too); files
    already there stay readable."""
    dirs = [root, *(Path(d) / n for d, names, _ in os.walk(root) for n in names)]
    made: list[Path] = []
    try:
        for d in dirs:
            done = subprocess.run(["chattr", "+i", str(d)], capture_output=True, text=True)
            if done.returncode != 0:
                raise DiskFaultUnavailable(f"cannot chattr +i {d}: {done.stderr.strip()}")
            made.append(d)
        yield
    finally:
        for d in reversed(made):
            subprocess.run(["chattr", "-i", str(d)], capture_output=True, check=False)
