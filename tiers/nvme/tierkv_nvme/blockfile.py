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

Load: one `preadv` reads the header into a small buffer, the payload straight into
the primary slot (no copy) and one spare byte (a file of the wrong length fails
without an `fstat`), then the frame is checked by the tier's `Framer` (every
header field, the flags strictly, the checksum over the slot itself, and the MAC when
the tier has a key). On a failed check the slot holds garbage and the key is reported
failed, so nobody reads it. The blocks of one thread call are opened a few at a time
and announced to the kernel together (`posix_fadvise(WILLNEED)`, `read_blocks`), so
the disk reads them all while the thread checks the first.

No symlink is followed below the tier's namespace directory: every operation opens
the fan-out directory from the namespace directory's descriptor (`root_fd`) with
`O_NOFOLLOW | O_DIRECTORY` and opens, renames and deletes the file relative to the
fan-out directory's descriptor, with `O_NOFOLLOW`. A fan-out directory (or a block file)
replaced by a link to elsewhere fails its key (ELOOP) instead of reading, writing or
deleting files outside the tier.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tierkv.contract.framing import FIXED_HEADER_BYTES, MAX_KEY_BYTES, Framer, Header
from tierkv.tier import CorruptBlock, OffloadKey, detached
from tierkv_nvme.layout import TEMP_SUFFIX, temp_name

RelPath = tuple[str, ...]
"""(fan-out directory, ..., file name) of a block: `layout.block_relpath`, or
`layout.legacy_relpath` for the two levels older tiers wrote."""
ReadItem = tuple[RelPath, OffloadKey, memoryview, bool]
"""A block `read_blocks` reads: where, its key, its slot, whether to refresh its mtime."""

logger = logging.getLogger(__name__)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC
TOUCH_AFTER_NS = 60 * 10**9
"""A load refreshes the file's mtime only when it is older than this: recency to the
minute is plenty for the LRU order a restart rebuilds, and a block loaded again and
again does not dirty its inode (a metadata write) every time."""


def _no_link(exc: OSError, where: str) -> OSError:
    """A clearer error for a symlink where the tier expects its own directory or file."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return OSError(
            errno.ELOOP,
            f"{where} is a symlink (or not a directory); the nvme tier does not follow "
            "links out of its directory: remove it",
        )
    return exc


def open_leaf(root_fd: int, rel: RelPath, *, create: bool) -> int:
    """A descriptor of the directory holding `rel`'s file under `root_fd` (its fan-out
    directories, walked without following symlinks); created when missing and
    `create`.

    Raises FileNotFoundError when missing and not `create`, OSError(ELOOP) for a link."""
    fd = root_fd
    try:
        for name in rel[:-1]:
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            if fd != root_fd:
                os.close(fd)
            fd = child
    except OSError as exc:
        if fd != root_fd:
            os.close(fd)
        raise _no_link(exc, "/".join(rel[:-1])) from None
    return fd


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not delete %s: %s", name, exc)


def delete_files(root_fd: int, rels: Iterable[RelPath]) -> int:
    """Delete the block files `rels`, ignoring ones already gone; return how many were
    deleted. Never follows a link out of the tier's directory.

    Errors other than "already gone" are logged, not raised: the index has already
    forgotten these blocks, and the next `open` finds and counts any file left over."""
    deleted = 0
    for rel in rels:
        try:
            leaf = open_leaf(root_fd, rel, create=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("could not delete %s: %s", "/".join(rel), exc)
            continue
        try:
            os.unlink(rel[-1], dir_fd=leaf)
            deleted += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not delete %s: %s", "/".join(rel), exc)
        finally:
            os.close(leaf)
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
    root_fd: int,
    rel: RelPath,
    key: OffloadKey,
    payload: memoryview,
    framer: Framer,
    *,
    fsync: bool,
) -> None:
    """Publish `key`'s frame at `rel` under `root_fd` atomically.

    Raises OSError (ENOSPC, EACCES, ELOOP for a link, ...) with no file left behind."""
    header = framer.encode_header(key, payload)  # checksums (and MACs) off the loop
    leaf = open_leaf(root_fd, rel, create=True)
    try:
        tmp = temp_name(rel[-1])
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC
        fd = os.open(tmp, flags, 0o644, dir_fd=leaf)
        try:
            try:
                _write_all(fd, (header, payload))
                if fsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            # rename never follows a link at the target: it replaces the name itself
            os.rename(tmp, rel[-1], src_dir_fd=leaf, dst_dir_fd=leaf)
        except BaseException:
            _unlink_quietly(tmp, leaf)
            raise
    finally:
        os.close(leaf)


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


def _discard_if_same(name: str, dir_fd: int, fd: int) -> None:
    """Delete `name` if it is still the file open as `fd`: a corrupt file is removed,
    but never a good block that replaced it meanwhile."""
    try:
        opened = os.fstat(fd)
        current = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return
    if (opened.st_dev, opened.st_ino) == (current.st_dev, current.st_ino):
        _unlink_quietly(name, dir_fd)


def open_block(root_fd: int, rel: RelPath) -> int:
    """A read-only descriptor of the block file at `rel` under `root_fd`, opened
    without following a link at any level. Raises FileNotFoundError when it is gone,
    OSError(ELOOP) for a link."""
    leaf = open_leaf(root_fd, rel, create=False)
    try:
        return os.open(rel[-1], os.O_RDONLY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=leaf)
    except OSError as exc:
        raise _no_link(exc, "/".join(rel)) from None
    finally:
        os.close(leaf)


def _discard_corrupt(root_fd: int, rel: RelPath, fd: int) -> None:
    """Delete the corrupt file open as `fd` if `rel` still names it."""
    try:
        leaf = open_leaf(root_fd, rel, create=False)
    except OSError:
        return
    try:
        _discard_if_same(rel[-1], leaf, fd)
    finally:
        os.close(leaf)


def read_opened(
    root_fd: int,
    rel: RelPath,
    fd: int,
    key: OffloadKey,
    dest: memoryview,
    framer: Framer,
    *,
    touch: bool = False,
    spare: bytearray | None = None,
) -> None:
    """Read and check `key`'s frame from `fd` (the file at `rel`), payload straight
    into `dest`: the file's length (one `preadv` into the header, `dest` and one spare
    byte: a file shorter or longer than a frame fails), then every header field, the
    checksum over `dest` itself, and the MAC when the tier has a key.

    Raises CorruptBlock (after deleting the file, if `rel` still names it) when any
    check fails, OSError on I/O errors. `dest` may have been written when a check
    fails. On success with `touch` the file's mtime is brought up to date (the tier
    asks when its index says the mtime is older than TOUCH_AFTER_NS): mtimes are the
    recency a restart rebuilds the LRU order from."""
    try:
        head = bytearray(framer.header_bytes(key))
        expected = len(head) + len(dest)
        buffers = (head, dest, spare if spare is not None else bytearray(1))
        got = os.preadv(fd, buffers, 0)
        if got < expected:  # a short read before the end of the file is rare: read again
            got = _read_all(fd, buffers)
        if got != expected:
            if got > expected:
                raise CorruptBlock(f"file is longer than a frame of this block ({expected} bytes)")
            raise CorruptBlock(f"file ended after {got} of {expected} bytes")
        framer.check_frame(head, key, dest)
    except CorruptBlock:
        _discard_corrupt(root_fd, rel, fd)
        raise
    if touch:
        os.utime(fd)


def read_block(
    root_fd: int, rel: RelPath, key: OffloadKey, dest: memoryview, framer: Framer
) -> None:
    """Read `key`'s frame from `rel` under `root_fd`, payload straight into `dest`,
    and check it (`read_opened`); its mtime is refreshed when older than
    TOUCH_AFTER_NS.

    Raises FileNotFoundError when the file is gone, CorruptBlock (after deleting the
    file) when any check fails, other OSError on I/O errors (ELOOP for a link)."""
    fd = open_block(root_fd, rel)
    try:
        touch = time.time_ns() - os.fstat(fd).st_mtime_ns > TOUCH_AFTER_NS
        read_opened(root_fd, rel, fd, key, dest, framer, touch=touch)
    finally:
        os.close(fd)


PREFETCH_BLOCKS = 16
"""Files of one `read_blocks` call opened and asked for (`POSIX_FADV_WILLNEED`) at
once: the disk reads them all while the thread checks them one by one. 16, since a
job of small blocks is one thread call where it was four calls of 4 at a time."""


def read_blocks(root_fd: int, items: Sequence[ReadItem], framer: Framer) -> list[Exception | None]:
    """`read_opened` for each of `items` (rel, key, slot, touch), one outcome each
    (None: read and checked), in one thread: groups of PREFETCH_BLOCKS files are opened
    and `posix_fadvise(WILLNEED)`ed first, so one thread keeps several reads in flight
    and a job needs fewer thread round trips for the same depth of I/O."""
    outcomes: list[Exception | None] = []
    spare = bytearray(1)
    for first in range(0, len(items), PREFETCH_BLOCKS):
        group = items[first : first + PREFETCH_BLOCKS]
        opened: list[int | Exception] = []
        try:
            for rel, _key, _dest, _touch in group:
                try:
                    opened.append(open_block(root_fd, rel))
                except OSError as exc:
                    opened.append(detached(exc))
            if len(group) > 1:
                for fd in opened:
                    if isinstance(fd, int):
                        with contextlib.suppress(OSError):
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            for (rel, key, dest, touch), fd in zip(group, opened):
                if isinstance(fd, Exception):
                    outcomes.append(fd)
                    continue
                try:
                    read_opened(root_fd, rel, fd, key, dest, framer, touch=touch, spare=spare)
                except Exception as exc:  # reported per key by the caller
                    outcomes.append(detached(exc))
                else:
                    outcomes.append(None)
        finally:
            for fd in opened:
                if isinstance(fd, int):
                    os.close(fd)
    return outcomes


def read_header(path: Path, framer: Framer, size: int) -> Header:
    """Parse and check the header of the block file at `path` (of `size` bytes)
    without reading the payload; the file itself is not followed if it is a link.
    Raises CorruptBlock or OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | _O_CLOEXEC)
    try:
        data = os.pread(fd, min(size, 4096), 0)
        try:
            header = framer.parse_header(data)
        except CorruptBlock:
            longest = FIXED_HEADER_BYTES + MAX_KEY_BYTES + 64
            if len(data) >= size or len(data) >= longest:
                raise
            data = os.pread(fd, min(size, longest), 0)
            header = framer.parse_header(data)
    finally:
        os.close(fd)
    return header


__all__ = [
    "ReadItem",
    "RelPath",
    "TEMP_SUFFIX",
    "delete_files",
    "open_block",
    "open_leaf",
    "read_block",
    "read_blocks",
    "read_opened",
    "read_header",
    "write_block",
]
