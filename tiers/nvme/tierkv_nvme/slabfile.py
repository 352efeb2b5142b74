"""The slab layout's files: blocks in fixed slots of SLAB_FILES files per namespace.

Why: a file per block costs an inode, a name and a page allocation to create and as
much to delete, on every store of a full tier; measured on the dev VM that is most of
a small block's store time (`benchmarks/nvme_layouts.py`, `benchmarks/README.md`). A
slot is written in place with one `pwritev` and read with one `preadv`, through a
descriptor the tier keeps open.

`slab_name(f)` for f = 0 .. SLAB_FILES - 1 in the namespace directory, each:

    superblock (PAGE bytes): magic "TKVSLABS" | version u16 | file index u16
        | files u32 | block bytes u64 | room u64 | namespace hash u64
        | xxh3_64 of the 40 bytes before it | zeros
    its slots, one after another from PAGE, each `room + PAGE` bytes:
        payload (block bytes) | zeros to `room` (block bytes rounded up to PAGE)
        | header page: check u64 | magic "TKVSLOT1" | seq u64 | frame length u32 | 0 u32
                       | frame header | zeros to PAGE

Slot `place` of the tier is slot `place // SLAB_FILES` of file `place % SLAB_FILES`
(`locate`): consecutive places are in different files, because writes into one file
take its inode's lock one at a time (Linux, buffered writes: measured on tmpfs, one
file held a store of 1 MiB blocks to one core's copying).

The frame header is the file layout's (`tierkv.contract.framing`, with its MAC when the
tier signs), byte for byte; the compiled core writes the same slots
(`_batchio.c`: `slab_write`, `slab_read`). `check` is the xxh3_64 of the header page
from its 8th byte to the frame header's end; `seq` orders writes (and loads that
refresh a slot), so the rebuild knows which copy of a key is newest and the LRU order.

Crash safety comes from the checksums, not from write order: a slot torn by a crash
(some pages new, some old) fails its header's check or its payload's checksum, so it
reads as a miss, never as wrong bytes. The one mix that passes is all old: the
evicted block that lay there, whole, which may come back after a restart as a correct
block. Removed blocks have their slot punched out (`release`), so a block a user
removed does not come back, and its bytes stop counting on the disk.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from tierkv.contract.framing import Framer, payload_length
from tierkv.tier import CorruptBlock, OffloadKey, detached
from tierkv_nvme.blockfile import PastDeadline, Slot, past

SLAB_FILES = 8
PAGE = 4096
SLAB_VERSION = 1
_SUPER = struct.Struct("<8sHHIQQQ")
_SUPER_MAGIC = b"TKVSLABS"
_SLOT = struct.Struct("<Q8sQII")  # check, magic, seq, frame length, 0
SLOT_HEAD_BYTES = _SLOT.size
_SLOT_MAGIC = b"TKVSLOT1"
MAX_FRAME_HEADER = PAGE - SLOT_HEAD_BYTES
"""The longest frame header a slot holds: keys up to ~4 KiB (less a MAC's 40 bytes)."""
_ZEROS = bytes(PAGE)


def room_for(block_bytes: int) -> int:
    """Payload bytes of a slot: the block rounded up to whole pages, so that every
    slot's payload and header page start on a page."""
    return -(-block_bytes // PAGE) * PAGE


def slot_bytes(block_bytes: int) -> int:
    """Bytes one slot takes in the file: its payload room and its header page."""
    return room_for(block_bytes) + PAGE


def slab_name(index: int) -> str:
    """The name of slab file `index` in the namespace directory."""
    return f"slots-{index:02d}.kvslab"


def locate(place: int, room: int) -> tuple[int, int]:
    """(file index, offset in it) where slot `place` starts."""
    return place % SLAB_FILES, PAGE + (place // SLAB_FILES) * (room + PAGE)


def file_slots(places: int, index: int) -> int:
    """Slots file `index` holds when the tier has `places`."""
    return len(range(index, places, SLAB_FILES))


def file_bytes(places: int, index: int, room: int) -> int:
    """The size of file `index` when the tier has `places` slots."""
    return PAGE + file_slots(places, index) * (room + PAGE)


def open_direct(fd: int, index: int, dir_fd: int) -> int:
    """Slab file `index` (open as `fd`) opened a second time below `dir_fd`, with
    O_DIRECT, for `direct: true`: its slots' payload and header pages then move
    between the disk and the blocks' memory without the page cache. The buffered `fd`
    stays for the rest (superblock, scan, punched holes, truncation, and blocks whose
    memory is not page aligned); Linux keeps the two coherent (a direct write drops
    the cached pages it covers, a direct read writes dirty ones back first).

    OSError when it cannot: EINVAL where the filesystem refuses O_DIRECT (the caller
    stays buffered), EXDEV should the name no longer be `fd`'s file."""
    direct = os.open(
        slab_name(index), os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd
    )
    mine, got = os.fstat(fd), os.fstat(direct)
    if (mine.st_dev, mine.st_ino) != (got.st_dev, got.st_ino):
        os.close(direct)
        raise OSError(errno.EXDEV, f"{slab_name(index)} is no longer the slab file opened")
    return direct


# -- the superblock ------------------------------------------------------------------
def superblock(index: int, block_bytes: int, room: int, namespace_tag: int) -> bytes:
    """The first page of slab file `index` for blocks of `block_bytes` in slots of
    `room`."""
    fields = _SUPER.pack(
        _SUPER_MAGIC, SLAB_VERSION, index, SLAB_FILES, block_bytes, room, namespace_tag
    )
    return (fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))).ljust(PAGE, b"\0")


def superblock_problem(
    page: bytes, index: int, block_bytes: int, room: int, namespace_tag: int
) -> str:
    """Why `page` is not the superblock of this tier's slab file `index` ("" when
    it is)."""
    if len(page) < _SUPER.size + 8:
        return "the file is shorter than its superblock"
    magic, version, at, files, blocks, slots, tag = _SUPER.unpack_from(page)
    (check,) = struct.unpack_from("<Q", page, _SUPER.size)
    if magic != _SUPER_MAGIC or check != xxhash.xxh3_64_intdigest(page[: _SUPER.size]):
        return "its superblock is not a tierkv slab's"
    if version != SLAB_VERSION:
        return f"slab format version {version} (this tierkv reads {SLAB_VERSION})"
    if tag != namespace_tag:
        return "it belongs to another namespace"
    if (at, files) != (index, SLAB_FILES):
        return f"it is file {at} of {files}, this tier's slabs are {SLAB_FILES} files"
    if (blocks, slots) != (block_bytes, room):
        return f"its slots hold blocks of {blocks} bytes, this tier's are {block_bytes}"
    return ""


# -- a slot's header page ---------------------------------------------------------------
def seal(frame_header: bytes, seq: int) -> bytes:
    """The header page of a slot holding a frame with `frame_header`, written `seq`."""
    if len(frame_header) > MAX_FRAME_HEADER:
        raise ValueError(
            f"a key of {len(frame_header) - 34} bytes does not fit a slab slot's header "
            f"(frame header {len(frame_header)} of at most {MAX_FRAME_HEADER} bytes); "
            "use `layout: files` for such keys"
        )
    body = _SLOT.pack(0, _SLOT_MAGIC, seq, len(frame_header), 0)[8:] + frame_header
    check = struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    return (check + body).ljust(PAGE, b"\0")


def unseal(page: bytes | bytearray | memoryview) -> tuple[int, bytes] | None:
    """(seq, frame header) of a slot header page (or its first part, up to the frame
    header's end); None for a slot never written, released (`release`), or torn."""
    check, magic, seq, frame_len, zero = _SLOT.unpack_from(page)
    if magic != _SLOT_MAGIC or zero or not 34 <= frame_len <= MAX_FRAME_HEADER:
        return None
    end = SLOT_HEAD_BYTES + frame_len
    if len(page) < end:  # only part of the header was read: not the frame expected
        return None
    if xxhash.xxh3_64_intdigest(bytes(page[8:end])) != check:
        return None
    return seq, bytes(page[SLOT_HEAD_BYTES:end])


# -- the Python path: one block at a time ------------------------------------------------
def _parts(payload: Slot) -> list[memoryview]:
    return [memoryview(p) for p in (payload if isinstance(payload, tuple) else (payload,))]


def _pwrite_all(fd: int, parts: list[memoryview], offset: int) -> None:
    while parts:
        put = os.pwritev(fd, parts, offset)
        if put <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += put
        while parts and put >= len(parts[0]):
            put -= len(parts[0])
            parts.pop(0)
        if put:
            parts[0] = parts[0][put:]


def write_slot(
    fds: Sequence[int],
    place: int,
    room: int,
    key: OffloadKey,
    payload: Slot,
    framer: Framer,
    seq: int,
) -> None:
    """Write one block into slot `place` of the slab files `fds` (payload, zeros,
    header page): one `pwritev`."""
    page = seal(framer.encode_header(key, payload), seq)
    gap = room - payload_length(payload)
    parts = [*_parts(payload), memoryview(_ZEROS)[:gap], memoryview(page)]
    index, offset = locate(place, room)
    _pwrite_all(fds[index], [p for p in parts if len(p)], offset)


def read_slot(
    fds: Sequence[int],
    place: int,
    room: int,
    key: OffloadKey,
    dest: Slot,
    framer: Framer,
    touch: int,
) -> None:
    """Read slot `place` into `dest` and check it (its header's check, then the frame
    as a file's is checked: key, length, checksum, MAC); `touch`: non-zero to rewrite
    its header page with that sequence once read. CorruptBlock when it fails."""
    regions = _parts(dest)
    page = bytearray(SLOT_HEAD_BYTES + framer.header_bytes(key))  # the page's used part
    gap = room - sum(map(len, regions))
    parts = [*regions, memoryview(bytearray(gap)), memoryview(page)]
    index, offset = locate(place, room)
    fd = fds[index]
    got = os.preadv(fd, [p for p in parts if len(p)], offset)
    if got < room + len(page):
        raise CorruptBlock("slab slot was never written (past the slab's end)")
    sealed = unseal(page)
    if sealed is None:
        raise CorruptBlock(
            "slab slot holds no whole block (never written, torn by a crash, or freed)"
        )
    _seq, frame_header = sealed
    framer.check_frame(frame_header, key, dest)
    if touch:
        os.pwrite(fd, seal(frame_header, touch), offset + room)


def write_slots(
    fds: Sequence[int],
    items: Sequence[tuple[int, OffloadKey, Slot, int]],
    room: int,
    framer: Framer,
    *,
    fsync: bool,
    deadline: float = 0.0,
) -> list[Exception | None]:
    """`write_slot` for each (place, key, payload, seq), one `fdatasync` after all
    when `fsync` (its failure fails every block); one outcome each (None: written;
    `PastDeadline` for a block not started by `deadline`)."""
    outcomes: list[Exception | None] = []
    for place, key, payload, seq in items:
        if past(deadline):
            outcomes.append(PastDeadline(f"slab slot {place}"))
            continue
        try:
            write_slot(fds, place, room, key, payload, framer, seq)
        except Exception as exc:  # reported per key by the caller
            outcomes.append(detached(exc))
        else:
            outcomes.append(None)
    if fsync and any(outcome is None for outcome in outcomes):
        try:
            for index in sorted({place % SLAB_FILES for place, _k, _p, _s in items}):
                os.fdatasync(fds[index])
        except OSError as exc:
            outcomes = [outcome or detached(exc) for outcome in outcomes]
    return outcomes


def read_slots(
    fds: Sequence[int],
    items: Sequence[tuple[int, OffloadKey, Slot, int]],
    room: int,
    framer: Framer,
    *,
    deadline: float = 0.0,
) -> list[Exception | None]:
    """`read_slot` for each (place, key, dest, touch seq); one outcome each
    (`PastDeadline` for a block not started by `deadline`)."""
    outcomes: list[Exception | None] = []
    for place, key, dest, touch in items:
        if past(deadline):
            outcomes.append(PastDeadline(f"slab slot {place}"))
            continue
        try:
            read_slot(fds, place, room, key, dest, framer, touch)
        except Exception as exc:  # reported per key by the caller
            outcomes.append(detached(exc))
        else:
            outcomes.append(None)
    return outcomes


_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)


def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's `fallocate(fd, mode, offset, length)` (Python's os has no mode flags)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.fallocate
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    call.restype = ctypes.c_int
    return call


_fallocate_call = _fallocate()


def release(fds: Sequence[int], places: Sequence[int], room: int) -> None:
    """Give each slot's disk space back (a hole punched over the whole slot, which also
    makes its header read as never written), so a removed block stays gone after a
    restart and its bytes stop counting on the disk. Where the filesystem cannot punch
    holes, its header's check and magic are zeroed instead (the space stays used until
    the slot is written again; the slot count still bounds it)."""
    for place in places:
        index, offset = locate(place, room)
        if _fallocate_call is not None:
            if _fallocate_call(fds[index], _PUNCH_HOLE, offset, room + PAGE) == 0:
                continue
            code = ctypes.get_errno()
            if code not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise OSError(code, os.strerror(code))
        os.pwrite(fds[index], _ZEROS[:16], offset + room)


# -- the rebuild ----------------------------------------------------------------------
@dataclass(frozen=True)
class FoundSlot:
    """A slot whose header passed the scan's checks."""

    place: int
    seq: int
    key: OffloadKey


SCAN_AHEAD = 64
"""Header pages a scan of a cold file has asked the disk for ahead of the one it reads
(the core's SCAN_AHEAD)."""
COLD_READ_NS = 10_000
"""A header page read this slow came from the disk (the core's COLD_READ_NS)..."""
COLD_READS = 3
"""...when this many in a row were: one slow read may be a preemption (on tmpfs, 32 of
32 scans saw one on the busy 2-core dev VM; the core's COLD_READS)."""


class _HeaderPages:
    """A scan's reads of slot header pages. Until COLD_READS reads in a row take
    COLD_READ_NS or longer (the pages come from the disk: a restart's cold file; or
    from the first with `cold`), pages are read as they come; once cold, each read
    first asks the kernel for the next SCAN_AHEAD slots' header pages
    (`POSIX_FADV_WILLNEED`: read asynchronously, past the file's `POSIX_FADV_RANDOM`),
    so the disk has that many reads in flight instead of one (a header page per slot
    at queue depth 1 cost a cold scan 60-85 us a slot on the dev VM's disk). By time,
    not `RWF_NOWAIT`: tmpfs refuses that flag, and its reads are never cold."""

    def __init__(self, fd: int, room: int, slots: int, cold: bool) -> None:
        self.fd, self.room, self.slots = fd, room, slots
        self.slow = COLD_READS if cold else 0  # slow reads in a row, up to COLD_READS
        self.advised = 0  # slots below this were asked for

    def head(self, slot: int) -> int:
        return PAGE + slot * (self.room + PAGE) + self.room

    def read(self, slot: int) -> bytes:
        if self.slow < COLD_READS:
            started = time.perf_counter_ns()
            page = os.pread(self.fd, PAGE, self.head(slot))
            slow = time.perf_counter_ns() - started >= COLD_READ_NS
            self.slow = self.slow + 1 if slow else 0
            return page
        self.advised = max(self.advised, slot)
        for ahead in range(self.advised, min(self.slots, slot + SCAN_AHEAD)):
            os.posix_fadvise(self.fd, self.head(ahead), PAGE, os.POSIX_FADV_WILLNEED)
            self.advised = ahead + 1
        return os.pread(self.fd, PAGE, self.head(slot))


def scan(
    fd: int, index: int, room: int, framer: Framer, block_bytes: int, cold: bool = False
) -> tuple[list[FoundSlot], int]:
    """Every slot of slab file `index` whose header page is whole and names a block of
    this namespace and size: (found, slots with a header that failed a frame check).
    Reads one page per slot (`_HeaderPages`: ahead on a cold disk; `cold`: from the
    first slot); holes (slots never written) are skipped with SEEK_DATA."""
    size = os.fstat(fd).st_size
    slots = max(0, (size - PAGE) // (room + PAGE))
    pages = _HeaderPages(fd, room, slots, cold)
    found: list[FoundSlot] = []
    bad = 0
    slot = 0
    while slot < slots:
        head = pages.head(slot)
        page = pages.read(slot)
        sealed = unseal(page) if len(page) == PAGE else None
        if sealed is None:
            if not any(page[:SLOT_HEAD_BYTES]):  # never written: skip the hole after it
                try:
                    data = os.lseek(fd, head + PAGE, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # no data past here
                        break
                    data = head + PAGE  # SEEK_DATA unsupported here: the next slot
                slot = max(slot + 1, (data - PAGE) // (room + PAGE))
                continue
            slot += 1
            continue
        seq, frame_header = sealed
        try:
            header = framer.parse_header(frame_header)
        except CorruptBlock:
            bad += 1
        else:
            if header.payload_length == block_bytes and header.size == len(frame_header):
                found.append(FoundSlot(slot * SLAB_FILES + index, seq, header.key))
            else:
                bad += 1
        slot += 1
    return found, bad


__all__ = [
    "MAX_FRAME_HEADER",
    "PAGE",
    "COLD_READ_NS",
    "SCAN_AHEAD",
    "SLAB_FILES",
    "FoundSlot",
    "file_bytes",
    "file_slots",
    "release",
    "locate",
    "open_direct",
    "read_slot",
    "read_slots",
    "room_for",
    "scan",
    "seal",
    "slab_name",
    "slot_bytes",
    "superblock",
    "superblock_problem",
    "unseal",
    "write_slot",
    "write_slots",
]
