"""Blocking file operations on one block, each run whole in one worker thread.

Why whole block operations in a thread call (the tier runs a few blocks per call)
rather than one await per file call (aiofiles' open, write, fsync, close, rename): a
block operation that runs to its end in one thread cannot be cut in half by
cancellation (the temporary file is renamed or removed by the call that created it),
the checksum is computed off the event loop, and a block costs a fraction of one
thread round trip (~50 us plus event-loop work) instead of five or six. The tier
awaits these calls through `anyio.to_thread` with a bounded limiter and shields them
from cancellation. `bench_nvme.py --aiofiles` times the alternative.

Store: header and payload go out in one `writev` from the primary slot (no copy) to a
temporary file, optionally `fdatasync`, then `rename` onto the final name. A crash at
any point leaves either the old state or the whole new block under the final name;
a temporary file left by a crash is deleted by the next `open`.

Load: one `preadv` reads the header into a small buffer and the payload straight into
the primary slot (no copy), then the frame is checked (`tierkv.framing`). On a failed
check the slot holds garbage and the key is reported failed, so nobody reads it.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tierkv.framing import (
    FIXED_HEADER_BYTES,
    MAX_KEY_BYTES,
    Header,
    check_header,
    encode_header,
    header_bytes,
    parse_header,
    verify_payload,
)
from tierkv.tier import CorruptBlock, OffloadKey
from tierkv_nvme.layout import temp_path

logger = logging.getLogger(__name__)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
TOUCH_AFTER_NS = 60 * 10**9
"""A load refreshes the file's mtime only when it is older than this: recency to the
minute is plenty for the LRU order a restart rebuilds, and a block loaded again and
again does not dirty its inode (a metadata write) every time."""


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not delete %s: %s", path, exc)


def delete_files(paths: Iterable[Path]) -> int:
    """Delete `paths`, ignoring ones already gone; return how many were deleted.

    Errors other than "already gone" are logged, not raised: the index has already
    forgotten these blocks, and the next `open` finds and counts any file left over."""
    deleted = 0
    for path in paths:
        try:
            os.unlink(path)
            deleted += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not delete %s: %s", path, exc)
    return deleted


def _write_all(fd: int, buffers: Sequence[bytes | memoryview]) -> None:
    """`writev` every byte of `buffers`, continuing after short writes."""
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    while pending:
        written = os.writev(fd, pending)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        while written and pending:
            head = pending[0]
            if written >= len(head):
                written -= len(head)
                pending.pop(0)
            else:
                pending[0] = head[written:]
                written = 0


def write_block(
    path: Path, key: OffloadKey, payload: memoryview, namespace: str, *, fsync: bool
) -> None:
    """Publish `key`'s frame at `path` atomically.

    Raises OSError (ENOSPC, EACCES, ...) with no file left behind."""
    header = encode_header(key, payload, namespace)  # checksums the payload, off the loop
    tmp = temp_path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileNotFoundError:  # first block in this fan-out directory
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, flags, 0o644)
    try:
        try:
            _write_all(fd, (header, payload))
            if fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _read_all(fd: int, buffers: Sequence[bytearray | memoryview]) -> int:
    """`preadv` from offset 0 into `buffers` until full or end of file; bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    wanted = sum(len(v) for v in views)
    total = 0
    while total < wanted:
        pending: list[memoryview] = []
        skip = total
        for view in views:
            if skip >= len(view):
                skip -= len(view)
                continue
            pending.append(view[skip:])
            skip = 0
        got = os.preadv(fd, pending, total)
        if got == 0:
            break
        total += got
    return total


def _discard_if_same(path: Path, fd: int) -> None:
    """Delete `path` if it is still the file open as `fd`: a corrupt file is removed,
    but never a good block that replaced it meanwhile."""
    try:
        opened = os.fstat(fd)
        current = os.stat(path)
    except OSError:
        return
    if (opened.st_dev, opened.st_ino) == (current.st_dev, current.st_ino):
        _unlink_quietly(path)


def read_block(path: Path, key: OffloadKey, dest: memoryview, namespace: str) -> None:
    """Read `key`'s frame from `path`, payload straight into `dest`, and check it.

    Raises FileNotFoundError when the file is gone, CorruptBlock (after deleting the
    file) when any check fails, other OSError on I/O errors. On success the file's
    mtime is brought up to date (see TOUCH_AFTER_NS): mtimes are the recency a restart
    rebuilds the LRU order from.
    """
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        try:
            head = bytearray(header_bytes(key))
            expected = len(head) + len(dest)
            stat = os.fstat(fd)
            size = stat.st_size
            if size != expected:
                raise CorruptBlock(f"file is {size} bytes, a frame of this block is {expected}")
            got = _read_all(fd, (head, dest))
            if got != expected:
                raise CorruptBlock(f"file ended after {got} of {expected} bytes")
            header = parse_header(bytes(head), namespace)
            check_header(header, key, len(dest))
            verify_payload(header, dest)
        except CorruptBlock:
            _discard_if_same(path, fd)
            raise
        if time.time_ns() - stat.st_mtime_ns > TOUCH_AFTER_NS:
            os.utime(fd)
    finally:
        os.close(fd)


def read_header(path: Path, namespace: str, size: int) -> Header:
    """Parse the header of the block file at `path` (of `size` bytes) without reading
    the payload. Raises CorruptBlock or OSError."""
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        data = os.pread(fd, min(size, 4096), 0)
        try:
            header = parse_header(data, namespace)
        except CorruptBlock:
            if len(data) >= size or len(data) >= FIXED_HEADER_BYTES + MAX_KEY_BYTES:
                raise
            data = os.pread(fd, min(size, FIXED_HEADER_BYTES + MAX_KEY_BYTES), 0)
            header = parse_header(data, namespace)
    finally:
        os.close(fd)
    return header
