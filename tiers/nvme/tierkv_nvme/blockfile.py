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
failed, so nobody reads it. The blocks of one thread call are opened a few at a time,
each read at once when the page cache holds it whole (`RWF_NOWAIT`), the rest
announced to the kernel together (`posix_fadvise(WILLNEED)`, `read_blocks`), so the
disk reads them all while the thread checks the first. A slot at a distance from its
payload's file offset that makes the copy slow (SHORT_DISTANCE) is read through a
scratch buffer instead.

No symlink is followed below the tier's namespace directory: every operation opens,
renames and deletes the file relative to its fan-out directory's descriptor, with
`O_NOFOLLOW`; the tier keeps those descriptors open, opened from the namespace
directory's descriptor with `O_NOFOLLOW | O_DIRECTORY` and checked once per thread
call against the name (`dirs.py`, the `leaves` argument). A fan-out directory (or a
block file) replaced by a link to elsewhere fails its key (ELOOP) instead of reading,
writing or deleting files outside the tier.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tierkv.contract.framing import (
    FIXED_HEADER_BYTES,
    MAX_KEY_BYTES,
    Framer,
    Header,
    copy_into,
    payload_length,
)
from tierkv.contract.slab import Regions
from tierkv.tier import CorruptBlock, OffloadKey, detached
from tierkv_nvme.dirs import Leaves, no_link
from tierkv_nvme.layout import TEMP_SUFFIX, temp_name

RelPath = tuple[str, ...]
"""(fan-out directory, ..., file name) of a block: `layout.block_relpath`, or
`layout.legacy_relpath` for the two levels older tiers wrote."""
Slot = memoryview | Regions
"""Where a block's payload lives: its slot, or the slot's regions in order (a block of
a `StridedView`: written with one `writev` of header and regions, read with one
`preadv` into them)."""
ReadItem = tuple[RelPath, OffloadKey, Slot, bool]
"""A block `read_blocks` reads: where, its key, its slot, whether to refresh its mtime."""

logger = logging.getLogger(__name__)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
TOUCH_AFTER_NS = 60 * 10**9
"""A load refreshes the file's mtime only when it is older than this: recency to the
minute is plenty for the LRU order a restart rebuilds, and a block loaded again and
again does not dirty its inode (a metadata write) every time."""


class PastDeadline(Exception):
    """A block its call did not start because the job's deadline had passed: nothing
    of it was read or written, its memory untouched. Not a fault of the medium: the
    tier fails the key as late and counts no read error against the block."""

    def __init__(self, where: str = "") -> None:
        super().__init__(f"not started: the job's deadline had passed ({where})")


def past(deadline: float) -> bool:
    """Whether `deadline` (`time.monotonic()` seconds; 0: none) has passed: asked
    before each block, so a job past its deadline stops within one block."""
    return deadline > 0 and time.monotonic() >= deadline


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not delete %s: %s", name, exc)


def delete_files(leaves: Leaves, rels: Iterable[RelPath]) -> int:
    """Delete the block files `rels`, ignoring ones already gone; return how many were
    deleted. Never follows a link out of the tier's directory.

    Errors other than "already gone" are logged, not raised: the index has already
    forgotten these blocks, and the next `open` finds and counts any file left over."""
    deleted = 0
    for rel in rels:
        try:
            leaf = leaves.get(rel[:-1], create=False)
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
    leaves: Leaves,
    rel: RelPath,
    key: OffloadKey,
    payload: Slot,
    framer: Framer,
    *,
    fsync: bool,
) -> None:
    """Publish `key`'s frame at `rel` (below `leaves`' namespace directory) atomically.

    Raises OSError (ENOSPC, EACCES, ELOOP for a link, ...) with no file left behind."""
    header = framer.encode_header(key, payload)  # checksums (and MACs) off the loop
    leaf = leaves.get(rel[:-1], create=True)
    tmp = temp_name(rel[-1])
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=leaf)
    try:
        try:
            _write_all(fd, (header, *payload) if isinstance(payload, tuple) else (header, payload))
            if fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        # rename never follows a link at the target: it replaces the name itself
        os.rename(tmp, rel[-1], src_dir_fd=leaf, dst_dir_fd=leaf)
    except BaseException:
        _unlink_quietly(tmp, leaf)
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


_O_NOATIME = getattr(os, "O_NOATIME", 0)


class _ReadFlags:
    """How block files are opened for reading: with `O_NOATIME` where the process may
    (it owns the files, or has CAP_FOWNER), so that a read does not write the inode.
    Under `relatime` (the usual mount option) the first read of a file written since
    its last read updates its access time: a metadata write, journalled, for every
    block read after its store. tierkv never uses access times (an LRU order rebuilt
    on open comes from the modification time a load refreshes, TOUCH_AFTER_NS). A
    file that refuses it (EPERM: another user's directory) turns it off for the
    process."""

    flags = os.O_RDONLY | os.O_NOFOLLOW | _O_CLOEXEC | _O_NOATIME


def open_block(leaves: Leaves, rel: RelPath) -> int:
    """A read-only descriptor of the block file at `rel`, opened without following a
    link at any level (nor updating its access time, `_ReadFlags`). Raises
    FileNotFoundError when it is gone, OSError(ELOOP) for a link."""
    leaf = leaves.get(rel[:-1], create=False)
    try:
        try:
            return os.open(rel[-1], _ReadFlags.flags, dir_fd=leaf)
        except PermissionError:
            if not _ReadFlags.flags & _O_NOATIME:
                raise
            _ReadFlags.flags &= ~_O_NOATIME  # not our files: read as anyone may
            return os.open(rel[-1], _ReadFlags.flags, dir_fd=leaf)
    except OSError as exc:
        raise no_link(exc, "/".join(rel)) from None


def _discard_corrupt(leaves: Leaves, rel: RelPath, fd: int) -> None:
    """Delete the corrupt file open as `fd` if `rel` still names it."""
    try:
        leaf = leaves.get(rel[:-1], create=False)
    except OSError:
        return
    _discard_if_same(rel[-1], leaf, fd)


_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_PAGE = mmap.PAGESIZE
_NOWAIT_REFUSED = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)
SHORT_DISTANCE = 64
"""A copy whose destination lies 1 to SHORT_DISTANCE - 1 bytes after its source,
modulo a page, is slow on x86 CPUs that copy with `rep movsb` (FSRM), the kernel's
copy to user memory included: on the dev VM's AMD EPYC a 32 KiB `preadv` took 13.5 us
instead of 2.2 us at distances 1-15, and glibc's `memcpy` 12 us instead of 1 (glibc's
own `memmove` avoids `rep movsb` at distances 1-63 on the Intel CPUs it knows to
suffer it; so 1-63 here). A frame's payload starts `header_bytes(key)` into its file
(56 bytes for SGLang's 22-byte keys), so a slot 64 bytes into a page (where a
64-byte-aligned allocation, such as torch's CPU tensors SGLang's host pools are made
of, puts it) was read at that slow distance. Such reads go through a scratch buffer
placed so that neither copy is short (`_Scratch`), if small (SCRATCH_MAX_BYTES)."""
SCRATCH_MAX_BYTES = 256 << 10
"""Slots up to this size are read through the scratch buffer when the copy would be
short; larger ones are read straight in, slow copy or not. The scratch buffer is
mapped afresh per thread call, and touching a fresh page cost ~4 us on the dev VM:
a call of 256 blocks of 32 KiB pays it once for ~11 us saved per block, a call of a
few 8 MiB blocks would pay 8 ms of it to save 2 ms a block (measured: 10.9 ms per read
through a fresh scratch against 2.9 ms straight in)."""


class _Cached:
    """Whether this process's files answer `preadv(RWF_NOWAIT)` (reads served from the
    page cache only): Linux 4.14+ on ext4, XFS, btrfs and others; a filesystem or kernel
    that refuses it turns it off for the process."""

    nowait = bool(_RWF_NOWAIT)


def _address(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def short_distance_possible(placement: tuple[int, int], head_bytes: int) -> bool:
    """Whether a slot placed as `placement` says (`PrimaryView.placement`: every region
    `residue` modulo `modulus`) can lie at a short distance (1 to SHORT_DISTANCE - 1
    bytes, modulo a page) after its payload's offset in a file whose frame header is
    `head_bytes` long. The regions of a block follow one another in the file as they
    do in the slot, modulo `modulus`, so one test covers them all."""
    modulus, residue = placement
    if modulus < SHORT_DISTANCE:
        return True
    return 0 < (residue - head_bytes) % modulus < SHORT_DISTANCE


class _Scratch:
    """Per thread call: the spare byte every read ends in, and a page-aligned buffer
    (mapped on first need) that frames are read through when the slot is at a short
    distance from the payload (SHORT_DISTANCE). With the slots' `placement` known, a
    header length at which no slot can be at such a distance costs no per-block test
    (`short_distance_possible`: SGLang's keys make every header a multiple of 64, the
    core's slab is page-aligned)."""

    __slots__ = ("_fine", "_map", "_placement", "spare")

    def __init__(self, placement: tuple[int, int] = (1, 0)) -> None:
        self.spare = bytearray(1)
        self._map: mmap.mmap | None = None
        self._placement = placement
        self._fine: dict[int, bool] = {}  # header length -> no slot can be short

    def never_short(self, head_bytes: int) -> bool:
        """No slot is at a short distance from a payload after `head_bytes`."""
        fine = self._fine.get(head_bytes)
        if fine is None:
            fine = self._fine[head_bytes] = not short_distance_possible(self._placement, head_bytes)
        return fine

    def frame(self, dest: Slot, head_bytes: int) -> memoryview | None:
        """Where to read the frame of `head_bytes` + `payload_length(dest)` bytes and a
        spare byte, so that both the kernel's copy into it and the copy of its payload
        into `dest` (each region) are at a distance of 0 or SHORT_DISTANCE or more;
        None when reading straight into `dest` is not slow (or `dest` is over
        SCRATCH_MAX_BYTES)."""
        if isinstance(dest, tuple):
            return self._frame_of_regions(dest, head_bytes, payload_length(dest))
        if len(dest) > SCRATCH_MAX_BYTES:
            return None
        try:
            distance = (_address(dest) - head_bytes) % _PAGE
        except (TypeError, ValueError):  # not a plain writable buffer: read straight in
            return None
        if not 0 < distance < SHORT_DISTANCE:
            return None
        return self._place(distance, head_bytes, len(dest))

    def _frame_of_regions(
        self, regions: Regions, head_bytes: int, length: int
    ) -> memoryview | None:
        """`frame` for a block of regions (`length` bytes in all): through scratch when
        any region lies at a short distance from where the file's bytes for it are."""
        if length > SCRATCH_MAX_BYTES or not regions:
            return None
        try:
            offset, short, distance = head_bytes, False, -1
            for region in regions:
                here = (_address(region) - offset) % _PAGE
                distance = here if distance < 0 else distance  # the first region's
                short |= 0 < here < SHORT_DISTANCE
                offset += len(region)
        except (TypeError, ValueError):  # not plain writable buffers: read straight in
            return None
        if not short:
            return None
        return self._place(distance, head_bytes, length)

    def _place(self, distance: int, head_bytes: int, length: int) -> memoryview:
        """The scratch bytes a frame of `head_bytes` + `length` (and a spare byte) is
        read into, its payload level with a destination `distance` past a page."""
        start = SHORT_DISTANCE + distance  # the frame's payload then sits level with dest
        size = start + head_bytes + length + 1
        if self._map is None or len(self._map) < size:
            self.close()
            self._map = mmap.mmap(-1, -(-size // _PAGE) * _PAGE)
        return memoryview(self._map)[start:size]

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held: unmapped with it
                self._map.close()
            self._map = None


def read_opened(
    leaves: Leaves,
    rel: RelPath,
    fd: int,
    key: OffloadKey,
    dest: Slot,
    framer: Framer,
    *,
    touch: bool = False,
    scratch: _Scratch | None = None,
    cached_only: bool = False,
) -> bool:
    """Read and check `key`'s frame from `fd` (the file at `rel`), payload into
    `dest`: the file's length (one `preadv` into the header, `dest` and one spare
    byte: a file shorter or longer than a frame fails), then every header field, the
    checksum over `dest` itself, and the MAC when the tier has a key. True when done.

    The payload goes straight into `dest`, unless `scratch` finds that copy slow
    (SHORT_DISTANCE): then the frame is read into the scratch buffer and its payload
    copied into `dest` (a copy of ~1 us for 32 KiB, against ~11 us lost).

    With `cached_only`, only what the page cache holds is read (`RWF_NOWAIT`): False,
    with nothing decided, when the frame is not all there (the caller reads it again
    without). A read of the cache that stops at the frame's end decides the file's
    length only when the spare byte after it lies in a page it read (the frame does
    not end on a page boundary); otherwise it, too, answers False.

    Raises CorruptBlock (after deleting the file, if `rel` still names it) when any
    check fails, OSError on I/O errors. `dest` may have been written when a check
    fails or False is returned. On success with `touch` the file's mtime is brought up
    to date (the tier asks when its index says the mtime is older than
    TOUCH_AFTER_NS): mtimes are the recency a restart rebuilds the LRU order from."""
    try:
        head_bytes = framer.header_bytes(key)
        one: memoryview | None  # the slot, when it is one region (the common case)
        if isinstance(dest, tuple):
            one, regions, expected = None, dest, head_bytes + payload_length(dest)
        else:
            one, regions, expected = dest, (), head_bytes + len(dest)
        frame = None
        if scratch is not None and not scratch.never_short(head_bytes):
            frame = (
                scratch.frame(one, head_bytes)
                if one is not None
                else scratch._frame_of_regions(regions, head_bytes, expected - head_bytes)
            )
        head: bytearray | memoryview
        buffers: tuple[bytearray | memoryview, ...]
        if frame is None:
            head = bytearray(head_bytes)
            spare = scratch.spare if scratch is not None else bytearray(1)
            buffers = (head, one, spare) if one is not None else (head, *regions, spare)
        else:
            head = frame[:head_bytes]
            buffers = (frame,)
        if cached_only:
            try:
                got = os.preadv(fd, buffers, 0, _RWF_NOWAIT)
            except BlockingIOError:
                return False
            except OSError as exc:
                if exc.errno not in _NOWAIT_REFUSED:
                    raise
                _Cached.nowait = False
                return False
            if got < expected or (got == expected and expected % _PAGE == 0):
                return False
        else:
            got = os.preadv(fd, buffers, 0)
            if got < expected:  # a short read before the end of the file is rare: again
                got = _read_all(fd, buffers)
        if got != expected:
            if got > expected:
                raise CorruptBlock(f"file is longer than a frame of this block ({expected} bytes)")
            raise CorruptBlock(f"file ended after {got} of {expected} bytes")
        if frame is not None:
            if one is not None:
                one[:] = frame[head_bytes:expected]
            else:
                copy_into(regions, (frame[head_bytes:expected],))
        framer.check_frame(head, key, dest)
    except CorruptBlock:
        _discard_corrupt(leaves, rel, fd)
        raise
    if touch:
        os.utime(fd)
    return True


def read_block(leaves: Leaves, rel: RelPath, key: OffloadKey, dest: Slot, framer: Framer) -> None:
    """Read `key`'s frame from `rel`, payload straight into `dest`,
    and check it (`read_opened`); its mtime is refreshed when older than
    TOUCH_AFTER_NS.

    Raises FileNotFoundError when the file is gone, CorruptBlock (after deleting the
    file) when any check fails, other OSError on I/O errors (ELOOP for a link)."""
    fd = open_block(leaves, rel)
    try:
        touch = time.time_ns() - os.fstat(fd).st_mtime_ns > TOUCH_AFTER_NS
        read_opened(leaves, rel, fd, key, dest, framer, touch=touch)
    finally:
        os.close(fd)


PREFETCH_BLOCKS = 16
"""Files of one `read_blocks` call opened at once: those the page cache does not hold
whole are asked for together (`POSIX_FADV_WILLNEED`), so the disk reads them all while
the thread checks them one by one. 16, since a job of small blocks is one thread call
where it was four calls of 4 at a time."""


def read_blocks(
    leaves: Leaves,
    items: Sequence[ReadItem],
    framer: Framer,
    placement: tuple[int, int] = (1, 0),
    *,
    deadline: float = 0.0,
) -> list[Exception | None]:
    """`read_opened` for each of `items` (rel, key, slot, touch), one outcome each
    (None: read and checked), in one thread, PREFETCH_BLOCKS files at a time: each
    file is opened and read at once if the page cache holds it whole (`RWF_NOWAIT`);
    from the first that it does not (a file partly cached would otherwise be copied
    twice), the rest of the group are `posix_fadvise(WILLNEED)`ed together and read, so
    one thread keeps several disk reads in flight and a job needs fewer thread round
    trips for the same depth of I/O. A block just written or read costs no advice
    call (a third of a 32 KiB block's system calls were directory opens and advice).
    `placement`: where the slots lie (`PrimaryView.placement`; by default unknown, and
    each slot's distance is tested). A block not started by `deadline` (`past`) is
    `PastDeadline`."""
    outcomes: list[Exception | None] = [None] * len(items)
    scratch = _Scratch(placement)
    try:
        _read_groups(leaves, items, framer, outcomes, scratch, deadline)
    finally:
        scratch.close()
    return outcomes


def _read_groups(
    leaves: Leaves,
    items: Sequence[ReadItem],
    framer: Framer,
    outcomes: list[Exception | None],
    scratch: _Scratch,
    deadline: float,
) -> None:
    """`read_blocks`' work, PREFETCH_BLOCKS files at a time, into `outcomes`."""
    for first in range(0, len(items), PREFETCH_BLOCKS):
        cold: list[tuple[int, int]] = []  # (index, fd) not read from the cache
        cached = _Cached.nowait  # page cache alone, until a block of the group is not there
        opened: list[int] = []
        try:
            for i in range(first, min(first + PREFETCH_BLOCKS, len(items))):
                rel, key, dest, touch = items[i]
                if past(deadline):
                    outcomes[i] = PastDeadline("/".join(rel))
                    continue
                try:
                    fd = open_block(leaves, rel)
                except OSError as exc:
                    outcomes[i] = detached(exc)
                    continue
                opened.append(fd)
                try:
                    done = cached and read_opened(
                        leaves,
                        rel,
                        fd,
                        key,
                        dest,
                        framer,
                        touch=touch,
                        scratch=scratch,
                        cached_only=True,
                    )
                except Exception as exc:  # reported per key by the caller
                    outcomes[i] = detached(exc)
                    continue
                if not done:
                    cold.append((i, fd))
                    cached = False  # the rest is likely cold too: advised and read with it
            if len(cold) > 1:
                for _i, fd in cold:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            for i, fd in cold:
                rel, key, dest, touch = items[i]
                if past(deadline):
                    outcomes[i] = PastDeadline("/".join(rel))
                    continue
                try:
                    read_opened(leaves, rel, fd, key, dest, framer, touch=touch, scratch=scratch)
                except Exception as exc:  # reported per key by the caller
                    outcomes[i] = detached(exc)
        finally:
            for fd in opened:
                os.close(fd)


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
    "PastDeadline",
    "ReadItem",
    "RelPath",
    "Slot",
    "TEMP_SUFFIX",
    "delete_files",
    "open_block",
    "past",
    "read_block",
    "read_blocks",
    "read_opened",
    "read_header",
    "short_distance_possible",
    "write_block",
]
