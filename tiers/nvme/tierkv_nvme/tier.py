"""`nvme`: KV blocks as checksummed files on a local disk.

One file per block (`layout.py`), each a `tierkv.contract.framing` frame published by
write-to-temporary + rename (`blockfile.py`), indexed in memory and rebuilt from the
directory on `open` (`recovery.py`).

Concurrency and consistency, all on the event-loop thread (no locks needed):

- The index maps each stored key to an entry (its bytes on disk) in LRU order; loads
  refresh recency, and so do stores of a key already held (same key, same bytes:
  keys are content hashes, so the write is skipped).
- A job runs as chunks of blocks (up to 2 MiB of blocks under 512 KiB, or MAX_CHUNK
  large ones, or for loads up to LARGE_LOAD_BYTES of them: `chunk_size`; the
  contract's `run_job`, with the tier's `job_timeout`), each chunk one worker-thread
  call that does every block
  whole; at most `io_concurrency` chunks run at once, across all jobs. The calls are
  shielded from cancellation, so a cancelled job never leaves half a block or an
  index that disagrees with the disk.
- A key being read is pinned, and a key a lookup claimed (`protects_claims`) is
  protected until its load or its lease ends: eviction passes over both. A key being
  written or deleted has a pending event; a store of the same key waits for it
  instead of racing it, so writes and deletes of one key never interleave.
- Capacity counts the disk bytes of indexed blocks plus those being written; room is
  made before a write by evicting the least recently used unpinned, unclaimed blocks
  (none left: the block fails "no room"), whose files
  are deleted by the same thread call that then writes the new blocks. A job bigger
  than the capacity fails the blocks that do not fit rather than evicting its own.
- The tier names its eviction candidates (`room`, `eviction_candidates`: the same
  order `_make_room` takes), so `admission: tinylfu` weighs a new block against the
  block it would displace.

An OSError on a block (disk full, permission, I/O error) fails that key with a
message naming the cause and the fix; the tier goes on serving other keys. A block is
deleted on a failed integrity check at once, on OS errors of its reads only after
READ_ERRORS_BEFORE_DELETE in a row (a hiccup is not data loss). Blocks the tier
deletes on its own (evicted for room, corrupt, unreadable, gone from the disk)
are `report_removed` once the thread that deleted them has returned. No symlink below
the namespace directory is followed (`blockfile`, `dirs`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

import anyio

from tierkv.contract.units import format_size
from tierkv.tier import (
    NO_ROOM,
    Batch,
    BlockThreads,
    CorruptBlock,
    FreeSlots,
    InFlightJobs,
    JobMetadata,
    JobResult,
    Lane,
    OffloadKey,
    PrimaryView,
    ReqContext,
    SecondaryTierManager,
    TierConfig,
    TierRoom,
    TierUnavailable,
    detached,
    in_batches,
    in_thread,
    run_job,
)
from tierkv_nvme import blockfile, native
from tierkv_nvme.blockfile import RelPath
from tierkv_nvme.config import NvmeTierConfig
from tierkv_nvme.dirs import FanoutDirs, open_namespace_dir
from tierkv_nvme.layout import (
    LOCK_NAME,
    NAMESPACE_NOTE,
    block_path,
    block_relpath,
    namespace_dir,
)
from tierkv_nvme.recovery import (
    ScanResult,
    cycles_uncollected,
    list_fanout_dirs,
    scan_fanout_dir,
)

logger = logging.getLogger(__name__)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS says, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


DEFAULT_FS_BLOCK = 4096
MAX_CHUNK = 4
"""Blocks per worker-thread call at most when a job is spread over `io_concurrency`
calls (large blocks, fsynced stores; see `chunk_size`)."""
CHUNK_BYTES = 4 << 20
"""Bytes of blocks worth one worker-thread call, MAX_CHUNK blocks at most (see
`chunk_size`)."""
SMALL_BLOCK_BYTES = 512 << 10
"""Blocks under this size are small (see `chunk_size`): 512 KiB blocks read from the
page cache went slower 8 a call than 4 (measured), so only smaller ones are batched
beyond the 4 a call they had."""
MAX_SMALL_CHUNK = {"load": 256, "store": 64}
"""Small blocks per worker-thread call at most, up to SMALL_CHUNK_BYTES of them (see
`chunk_size`): one SGLang load of 128 pages of 64 KiB (256 blocks) is one thread call."""
SMALL_CHUNK_BYTES = {"load": 8 << 20, "store": 2 << 20}
"""Bytes of small blocks worth one worker-thread call (see `chunk_size`). A load of
8 MiB is about a millisecond of copying from the page cache (what a chunk still
running at the job's deadline overruns it by); stores stay at 2 MiB, since creating
files is kernel work that several threads overlap (one thread call per 256-block
store was slower, measured)."""
LARGE_LOAD_BYTES = 16 << 20
"""Bytes of large blocks one worker-thread call of a load may take (see `chunk_size`):
a load job of many large blocks is spread over `io_concurrency` calls of up to this
much, not over calls of MAX_CHUNK blocks. Measured through SGLang's interface (128
pages a call, read from the page cache, 2-core VM): 512 KiB pages 200 us a page at 4
blocks a call, 100 us at 32; 1 MiB pages 220-257 us at 4, 191-196 at 16. Each thread
call cost the event loop ~200 us of CPU (anyio's hand-off), per block a quarter of
that at 4 a call."""
SPREAD_MIN_BLOCKS = 16
"""Blocks a thread call takes at least when a job running alone is spread over the
CPUs (`spread_alone`): below that the hand-off costs more than the overlap gives."""
_TYPICAL_KEY_BYTES = 36
"""A sha256 block hash and its group: the key length `room` sizes a block by."""
READ_ERRORS_BEFORE_DELETE = 3
"""Reads of one block in a row that may fail with an OS error (EIO, a link where
the file should be, ...) before the block is given up and deleted: one hiccup must
not destroy data, a file that never reads again must not be promoted forever.
A failed integrity check (checksum, MAC, header) deletes the block at once."""


def disk_footprint(frame_bytes: int, fs_block: int = DEFAULT_FS_BLOCK) -> int:
    """Bytes a file of `frame_bytes` occupies: rounded up to whole filesystem blocks.

    Capacity counts this, not the frame length, so `capacity: 100GiB` bounds what the
    disk really gives up even for small blocks (a 16 KiB block with its header takes
    20 KiB)."""
    return -(-frame_bytes // fs_block) * fs_block


@dataclass(frozen=True)
class RecoveryReport:
    """What the last `open` found on disk."""

    blocks: int
    bytes: int
    removed_temp: int
    removed_bad: int
    evicted_over_capacity: int
    moved_up: int = 0
    """Blocks found in the two-level layout of earlier tiers and moved up a level."""
    converted: int = 0
    """Block files moved into the slots of `layout: slab` (`tierkv_nvme.convert`)."""


class _Entry:
    """One indexed block. Compared by identity, so a slow reader that finds its file
    corrupt forgets that entry only, not a newer one stored under the same key."""

    __slots__ = ("footprint", "place", "read_errors", "touched_ns")

    def __init__(self, footprint: int, touched_ns: int, place: int = -1) -> None:
        self.footprint = footprint
        self.read_errors = 0  # OS errors of the reads in a row before this one
        self.touched_ns = touched_ns
        """The file's mtime as this tier last set or found it: a load refreshes it
        when older than `blockfile.TOUCH_AFTER_NS` (no `fstat` per read to learn it)."""
        self.place = place
        """Where the block lies in its medium when the key does not say (the slab
        layout's slot, `tierkv_nvme.slab`); -1 for a file named by its key."""


_FIRST, _SECOND = itemgetter(0), itemgetter(1)  # of (key, slot) pairs, in C
_TOUCHED, _READ_ERRORS = attrgetter("touched_ns"), attrgetter("read_errors")  # of entries


class NvmeTier(SecondaryTierManager):
    """Blocks as files under `config.path`, LRU-evicted past `config.capacity`."""

    Config = NvmeTierConfig
    config: NvmeTierConfig
    reports_evictions = True
    protects_claims = True
    lookup_answers_from_memory = True  # its index (and two system calls: `_ready`)
    names_eviction_candidates = True
    accepts_regions = True  # a block of several regions is one file (header, regions)
    _io_engine = "python"  # what moves the bytes: set by `open` (`native.choose`)
    _lanes: tuple[Lane, ...] | None = None
    """The primary's geometry when the core's batch calls move the blocks (`open`):
    names, addresses and frames made in C, no Python per block; None: per block."""

    def __new__(cls, config: TierConfig, primary: PrimaryView) -> NvmeTier:
        """`paths:` of several directories makes a tier striped over them
        (`tierkv_nvme.striped.StripedNvmeTier`, built whole here); else this class."""
        if cls is NvmeTier and len(getattr(config, "paths", None) or ()) > 1:
            from tierkv_nvme.striped import StripedNvmeTier  # it imports this module

            return StripedNvmeTier(config, primary)  # type: ignore[return-value]
        if cls is NvmeTier and getattr(config, "layout", "files") == "slab":
            from tierkv_nvme.slab import SlabNvmeTier  # it imports this module

            return SlabNvmeTier(config, primary)
        return super().__new__(cls)

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        super().__init__(config, primary)
        self.directory = namespace_dir(self.config.path, primary.namespace)
        self._index: OrderedDict[OffloadKey, _Entry] = OrderedDict()
        self._used = 0  # footprint of indexed blocks
        self._reserved = 0  # footprint of blocks being written
        self._pins: dict[OffloadKey, int] = {}
        self._writing: dict[OffloadKey, anyio.Event | None] = {}
        """Keys being written; the event is made only when another store waits (an
        `anyio.Event` per block written cost a tenth of the loop's time on 32 KiB
        blocks)."""
        self._deleting: dict[OffloadKey, anyio.Event] = {}
        concurrency = self.config.io_concurrency
        self._io_slots = FreeSlots(concurrency)
        self._threads = BlockThreads(concurrency, "tierkv-nvme")
        self._queue: native.CoreQueue | None = None
        """The core's own threads, fed from the event loop (the layouts' core
        calls, `_write_call` and `_read_call`); None: every call goes to `_threads`."""
        self._inflight = InFlightJobs(self.name)
        self._fs_block = DEFAULT_FS_BLOCK
        self._footprints: dict[int, int] = {}  # key length -> disk bytes (`footprint`)
        self._calls = 0  # block-I/O thread calls in flight (`_core_threads`)
        self._block_footprint = 0  # the last block stored (`room` counts in it)
        self._lock_fd: int | None = None
        self._root_fd = -1  # the namespace directory, opened without following links
        self._dirs = FanoutDirs(-1)  # its fan-out directories' descriptors, kept
        self._retired: list[tuple[int | None, int, FanoutDirs]] = []
        """Descriptors of a directory that vanished (`_retake`): other threads may
        still use them, so they close with the tier, not at once."""
        self._generation = 0  # one more each time the directory is taken again
        self._retaking: anyio.Lock | None = None
        self._state = "new"
        self.recovery: RecoveryReport | None = None

    @staticmethod
    def get_tier_type() -> str:
        return "nvme"

    @classmethod
    def installation(cls) -> dict[str, str]:
        """Whether the compiled core is built here (`io_engine: auto` uses it then)."""
        if native.AVAILABLE:
            return {"io engine": "native: the compiled core is built (auto uses it)"}
        return {"io engine": f"python only: {native.reason}"}

    # -- introspection ------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Disk bytes of the blocks held (each file rounded up to the fs block)."""
        return self._used

    @property
    def fs_block(self) -> int:
        """The filesystem block size capacity is counted in (known after `open`)."""
        return self._fs_block

    def __len__(self) -> int:
        return len(self._index)

    def path_of(self, key: OffloadKey) -> Path:
        """The file that holds (or would hold) `key`."""
        return block_path(self.directory, key)

    def rel_of(self, key: OffloadKey) -> RelPath:
        """Where `key`'s file is, relative to the namespace directory."""
        return block_relpath(key)

    def footprint(self, key: OffloadKey) -> int:
        """Disk bytes one block stored under `key` takes (by the key's length: the
        frame's size depends on nothing else; remembered per length)."""
        known = self._footprints.get(len(key))
        if known is None:
            frame = self.framer.frame_bytes(key, self.primary.block_bytes)
            known = self._footprints[len(key)] = disk_footprint(frame, self._fs_block)
        return known

    def room(self) -> TierRoom:
        """Blocks of the primary's size (each counted by its disk footprint, as
        capacity is: the last block stored, or one of a 36-byte key before any) that
        fit before `_make_room` must evict, and that fit in all."""
        capacity = int(self.config.capacity)
        block = self._block_footprint or self.footprint(bytes(_TYPICAL_KEY_BYTES))
        free = max(0, capacity - self._used - self._reserved)
        return TierRoom(free // block, capacity // block)

    def eviction_candidates(self) -> Iterator[OffloadKey]:
        """Least recently used first, passing over pinned and claimed blocks (the
        order `_make_room` evicts in)."""
        pins, claims = self._pins, self.claims
        if not pins and not claims:  # nothing read or claimed: the order itself
            return iter(self._index)
        return (k for k in self._index if not pins.get(k) and not claims.is_protected(k))

    def describe(self) -> dict[str, Any]:
        return {
            "type": self.get_tier_type(),
            "path": str(self.config.path),
            "directory": str(self.directory),
            "blocks": len(self._index),
            "used_bytes": self._used,
            "capacity": int(self.config.capacity),
            "fsync": self.config.fsync,
            "io_concurrency": self.config.io_concurrency,
            "mac": self.framer.mac,
            "io_engine": self._io_engine,
            # the core's xxh3 loop's vector width (512: AVX-512, 256: AVX2, 128: SSE2)
            "checksum_bits": native.checksum_bits() if self._io_engine == "native" else None,
            # chunks the core's BLAKE3 hashes at once (16: AVX-512, 8: AVX2, 1: portable)
            "mac_lanes": native.blake3_lanes()
            if self.framer.mac and self._io_engine == "native"
            else None,
            "batch_calls": self._lanes is not None,
            "core_queue": self._queue is not None and self._state != "closed",
            "layout": self.config.layout,
        }

    # -- life cycle ---------------------------------------------------------------
    async def open(self) -> None:
        """Take the directory, rebuild the index from it, and enforce capacity.

        Raises TierUnavailable when the directory cannot be created or locked (another
        tier instance, in this or another process, already uses it), or when other
        users may write it or its `path` (`dirs.open_namespace_dir`)."""
        if self._state != "new":
            raise TierUnavailable(f"nvme tier at {self.directory} was already opened")
        self._io_engine, why = native.choose(self.config.io_engine)
        self.data_path = self._io_engine
        logger.info("nvme tier %s: io engine %s (%s)", self.directory, self._io_engine, why)
        try:
            self._fs_block = await anyio.to_thread.run_sync(self._take_directory)
            self._footprints.clear()
        except OSError as exc:
            raise TierUnavailable(
                f"nvme tier cannot use {self.directory}: {exc.strerror or exc}; check that "
                "`path` is a directory tierkv may create and write"
            ) from exc
        self._lanes = self._batch_lanes()
        if self._io_engine == "native" and self._lanes is not None:
            self._queue = native.CoreQueue(self.config.io_concurrency)
        if self._io_engine == "native" and self._lanes is None:
            self.data_path = "native-blocks"  # the core's per-block calls (`_write_files`)
            logger.info(
                "nvme tier %s: the core moves blocks one call per block (%s)",
                self.directory,
                "the primary's slots have no one geometry (lent slots)"
                if native.batch_ready()
                else "the kernel cannot open below a directory without links (openat2)",
            )
        try:
            with cycles_uncollected():
                scan = await self._scan()
                self._rebuild(scan)
            evicted = await self._enforce_capacity()
        except OSError as exc:
            self._release_lock()
            raise TierUnavailable(
                f"nvme tier cannot read its directory {self.directory}: {exc}"
            ) from exc
        except BaseException:
            self._release_lock()
            raise
        self.recovery = RecoveryReport(
            blocks=len(self._index),
            bytes=self._used,
            removed_temp=len(scan.removed_temp),
            removed_bad=len(scan.removed_bad),
            evicted_over_capacity=evicted,
            moved_up=scan.moved_up,
            converted=scan.converted,
        )
        self._state = "open"
        logger.info(
            "nvme tier %s: %d blocks (%s) recovered; deleted %d temporary and %d bad "
            "files; evicted %d blocks over capacity; moved %d blocks of the two-level "
            "layout up a level and %d block files into slab slots",
            self.directory,
            self.recovery.blocks,
            format_size(self._used),
            self.recovery.removed_temp,
            self.recovery.removed_bad,
            evicted,
            scan.moved_up,
            scan.converted,
        )

    def _batch_lanes(self) -> tuple[Lane, ...] | None:
        """The primary's geometry when the core's batch calls can move the blocks
        (native, and the kernel opens below a directory without links), else None."""
        if self._io_engine == "native" and native.batch_ready(self._root_fd):
            return self.primary.lanes
        return None

    def _take_directory(self) -> int:
        """Create and lock the namespace directory; return its filesystem block size.

        The lock (flock on `lock`, released when its descriptor closes, even by a
        crash) keeps a second tier from rebuilding this index meanwhile and deleting
        the temporary files of writes still in flight. Both directories are made 0700
        where missing and must be private (`dirs.open_namespace_dir`: TierUnavailable
        naming the fix where other users may write them)."""
        root = open_namespace_dir(self.directory.parent, self.directory.name)
        try:
            fd = os.open(
                LOCK_NAME,
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o600,
                dir_fd=root,
            )
        except BaseException:
            os.close(root)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            os.close(root)
            raise TierUnavailable(
                f"nvme tier directory {self.directory} is in use by another tier "
                f"(process {holder}); give each tier its own `path` or namespace"
            ) from None
        except BaseException:
            os.close(fd)
            os.close(root)
            raise
        self._lock_fd = fd
        self._root_fd = root
        self._dirs = FanoutDirs(root)
        try:  # courtesy notes, for error messages and people browsing the disk; a full
            # disk must not keep the tier from opening and serving what it holds
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            try:
                note = os.open(
                    NAMESPACE_NOTE,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                    0o600,
                    dir_fd=root,
                )
            except FileExistsError:
                pass
            else:
                try:
                    os.write(note, (self.primary.namespace + "\n").encode())
                finally:
                    os.close(note)
        except OSError as exc:
            logger.warning("nvme tier: could not write notes in %s: %s", self.directory, exc)
        return os.fstatvfs(root).f_frsize or DEFAULT_FS_BLOCK

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._dirs.close()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1
        for lock_fd, root_fd, dirs in self._retired:
            dirs.close()
            for fd in (lock_fd, root_fd):
                if fd is not None and fd >= 0:
                    os.close(fd)
        self._retired.clear()

    # -- a directory removed under the tier -----------------------------------------
    def _vanished(self) -> bool:
        """Whether the namespace directory the tier holds is gone: removed (no links
        left), or its path now names another directory, or nothing. Two system calls;
        every lookup, store and load asks, so a tier never answers for files that
        went with their directory."""
        if self._root_fd < 0:
            return True
        try:
            held = os.fstat(self._root_fd)
            now = os.stat(self.directory, follow_symlinks=False)
        except OSError:
            return True
        return held.st_nlink == 0 or (now.st_ino, now.st_dev) != (held.st_ino, held.st_dev)

    async def _ready(self) -> None:
        """Open, and its directory still there: else forget every block (they went
        with it) and take the directory again, made anew. Raises TierUnavailable when
        it cannot be made (the caller's breaker then counts the tier down, and its
        probe tries again)."""
        self._check_open()
        if not self._vanished():
            return
        if self._retaking is None:
            self._retaking = anyio.Lock()
        async with self._retaking:
            if self._vanished():
                await self._retake()

    async def _retake(self) -> None:
        lost = list(self._index)
        logger.warning(
            "nvme tier: its directory %s was removed or replaced outside tierkv; the %d "
            "blocks it held are forgotten and the directory is made anew",
            self.directory,
            len(lost),
        )
        self._index.clear()
        self._used = 0
        self._generation += 1  # writes in flight into the old directory are lost too
        if self._root_fd >= 0:  # retired, not closed: a worker thread may be using them
            self._retired.append((self._lock_fd, self._root_fd, self._dirs))
        self._lock_fd, self._root_fd, self._dirs = None, -1, FanoutDirs(-1)
        try:
            if lost:
                self.report_removed(lost)
        finally:
            try:
                self._fs_block = await anyio.to_thread.run_sync(self._take_directory)
                self._footprints.clear()
            except (OSError, TierUnavailable) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                raise TierUnavailable(
                    f"nvme tier directory {self.directory} vanished and cannot be made "
                    f"again: {reason}; check that `path` exists and tierkv may write it"
                ) from exc

    async def _scan(self) -> ScanResult:
        tops, others = await in_thread(list_fanout_dirs, self.directory)
        total = ScanResult()
        for other in others:
            if other.name not in (LOCK_NAME, NAMESPACE_NOTE):
                total.ignored.append(other)

        async def scan(top: Path) -> None:
            part = await self._threads.run(
                scan_fanout_dir, top, self.framer, self.primary.block_bytes
            )
            total.merge(part)

        async with anyio.create_task_group() as tg:
            for top in tops:
                tg.start_soon(scan, top)
        for path, reason in total.removed_bad:
            logger.warning("nvme tier: deleted %s: %s", path, reason)
        if total.ignored:
            logger.warning(
                "nvme tier: %d entries under %s are not tierkv blocks and were left "
                "alone (first: %s)",
                len(total.ignored),
                self.directory,
                total.ignored[0],
            )
        return total

    def _rebuild(self, scan: ScanResult) -> None:
        """Index the found blocks, oldest mtime first (the LRU end)."""
        self._index.clear()
        self._used = 0
        for block in sorted(scan.blocks, key=lambda b: b.mtime_ns):
            footprint = disk_footprint(block.frame_bytes, self._fs_block)
            self._index[block.key] = _Entry(footprint, block.mtime_ns)
            self._used += footprint

    async def _enforce_capacity(self) -> int:
        """Delete the oldest blocks until the rest fit `capacity` (it may have shrunk
        since the last run, or files were added by hand)."""
        capacity = int(self.config.capacity)
        victims: list[OffloadKey] = []
        while self._index and self._used > capacity:
            key, entry = self._index.popitem(last=False)
            self._used -= entry.footprint
            victims.append(key)
        if victims:
            await in_thread(self._delete_files, [self.rel_of(k) for k in victims])
            self.report_removed(victims)
        return len(victims)

    async def close(self) -> None:
        """Let running jobs finish, then release the directory. Idempotent."""
        if self._state == "closed":
            return
        self._state = "closing"
        await self._inflight.drain()
        self._threads.close()
        if self._queue is not None:
            self._queue.close()
        self._release_lock()
        self.claims.clear()
        self._index.clear()
        self._used = 0
        self._state = "closed"

    def _check_open(self) -> None:
        if self._state != "open":
            raise TierUnavailable(f"nvme tier at {self.directory} is not open ({self._state})")

    # -- the contract -------------------------------------------------------------
    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        await self._ready()
        index = self._index
        return [key in index for key in keys]

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Refresh the LRU order in memory (no I/O: a restart orders blocks by the
        time of their last store or load, as before)."""
        if self._state != "open":
            return
        index = self._index
        for key in keys:
            if key in index:
                index.move_to_end(key)

    async def store(self, job: JobMetadata) -> JobResult:
        await self._ready()
        written: list[OffloadKey] = []  # pinned until the job ends: never its own victims

        async def store_chunk(chunk: Batch, deadline: float) -> dict[OffloadKey, str]:
            return await self._store_chunk(chunk, written, deadline)

        async with self._inflight.job():
            try:
                result = await self._in_chunks(job, store_chunk, "store")
            finally:
                self._unpin(written)
        if result.failed_keys:
            logger.warning(
                "nvme tier: %d of %d blocks of job %d not stored: %s",
                len(result.failed_keys),
                len(job.keys),
                job.job_id,
                result.error,
            )
        return result

    async def load(self, job: JobMetadata) -> JobResult:
        await self._ready()
        async with self._inflight.job():
            return await self._in_chunks(job, self._load_chunk, "load")

    async def remove(self, keys: Sequence[OffloadKey]) -> None:
        self._check_open()
        async with self._inflight.job():
            targets = self._unindex(keys)
            for key, _entry in targets:
                self._deleting[key] = anyio.Event()
            if not targets:
                return
            try:
                await self._threads.run(self._delete_blocks, targets, shield=True)
            finally:
                self._finish_deleting([key for key, _entry in targets])
                self._dropped(targets)

    def _unindex(self, keys: Sequence[OffloadKey]) -> list[tuple[OffloadKey, _Entry]]:
        """Take the held ones of `keys` out of the index (their bytes no longer used):
        what `remove` deletes and a slab's `evict` frees."""
        targets: list[tuple[OffloadKey, _Entry]] = []
        for key in dict.fromkeys(keys):
            entry = self._index.pop(key, None)
            if entry is not None:
                self._used -= entry.footprint
                targets.append((key, entry))
        return targets

    # -- per chunk of blocks ------------------------------------------------------
    async def _in_chunks(
        self,
        job: JobMetadata,
        run_chunk: Callable[[Batch, float], Awaitable[dict[OffloadKey, str]]],
        verb: str,
    ) -> JobResult:
        """Run `job` as chunks (`chunk_size`), one worker-thread call each,
        up to `io_concurrency` in flight, by the contract's runner.

        Chunks, not single blocks, because a thread round trip and the event-loop work
        around it cost about as much CPU as reading a 1 MiB block from the page cache;
        small chunks, so a cancelled job waits for little shielded work.

        Each call is given the job's deadline (`job_timeout` from now, as the runner
        keeps it): a call still running then starts no further block (`PastDeadline`),
        so the job stops within one block per thread rather than finishing its chunks.
        That matters under an engine, whose pages are its own: the adapter answers a
        miss at the deadline and may see the page reused while a call would still
        have read into it, or stored from it."""
        size = self.chunk_size(len(job.keys), verb)
        if self._inflight.count == 1:  # this job alone: spread it over the CPUs
            size = self.spread_alone(size, len(job.keys), verb)
        timeout = self.config.job_timeout
        deadline = 0.0 if timeout is None else time.monotonic() + float(timeout)

        async def chunk(pairs: Batch) -> dict[OffloadKey, str]:
            return await run_chunk(pairs, deadline)

        return await run_job(
            job,
            chunk,
            label=f"nvme {verb}",
            concurrency=self.calls_at_once(size, verb),
            timeout=self.config.job_timeout,
            batches=in_batches(job, size),
        )

    def spread_alone(self, chunk: int, pairs: int, verb: str) -> int:
        """`chunk`, cut so that a job of small blocks running alone in the tier is
        `usable_cpus()` thread calls side by side rather than one: while one call's
        blocks are copied, the event loop books another's (index, pins, results), so
        its Python stops adding to the job's time. A job beside others is left whole:
        they overlap already. Not below SPREAD_MIN_BLOCKS blocks a call, and only on
        the compiled core (Python's copies hold the GIL, so its calls would take turns:
        1.5-2x the CPU, measured before the core). Measured
        through SGLang's interface (128 pages of 64 KiB a call, tmpfs, 2-core VM,
        interleaved): gets 47-57k pages/s against 46-50k whole."""
        block = self.primary.block_bytes
        cpus = usable_cpus()
        if self._io_engine != "native":  # Python copies hold the GIL: no overlap to gain
            return chunk
        if block >= SMALL_BLOCK_BYTES or cpus < 2 or pairs < 2 * SPREAD_MIN_BLOCKS:
            return chunk
        if verb == "store" and self.config.fsync == "always":
            return chunk  # spread over io_concurrency calls already
        return max(SPREAD_MIN_BLOCKS, min(chunk, -(-pairs // cpus)))

    def calls_at_once(self, chunk: int, verb: str) -> int:
        """Thread calls of one job in flight at most: `io_concurrency`, but no more than
        the CPUs this process may run on for a load whose calls each read
        PREFETCH_BLOCKS large blocks or more. Such a call keeps its own reads in flight
        (`posix_fadvise(WILLNEED)` of its group of files), so more calls add no disk
        depth, only threads taking the GIL and the memory bus from one another when
        the page cache serves the reads: 128 pages of 1 MiB through SGLang's interface
        on the 2-core dev VM went 1.48x the `file` backend at 8 calls, 1.79x at 2."""
        most = self.config.io_concurrency
        if (
            verb == "load"
            and chunk >= blockfile.PREFETCH_BLOCKS
            and self.primary.block_bytes >= SMALL_BLOCK_BYTES
        ):
            return max(1, min(most, usable_cpus()))
        return most

    def chunk_size(self, pairs: int, verb: str) -> int:
        """Blocks per worker-thread call for a job of `pairs` blocks.

        A thread round trip and the event-loop work around it cost 40-370 us of CPU
        (measured, quiet to busy machine), more than reading a 256 KiB block from the
        page cache. Small blocks are therefore read, and written without fsync, in
        whole chunks of up to SMALL_CHUNK_BYTES (at most MAX_SMALL_CHUNK blocks; but
        never fewer than CHUNK_BYTES in MAX_CHUNK blocks, as before): one read
        call keeps its chunk's reads in flight (`posix_fadvise(WILLNEED)`,
        `blockfile.read_blocks`), and a write that is not fsynced only copies into the
        page cache, so more calls buy no depth. With 4 blocks a call, 32 KiB blocks
        (SGLang's 64 KiB pages) spent most of the event loop's time on hand-offs; with
        64 a call, one 128-page SGLang load ran as 4 thread calls side by side that
        spent 1.5-2x the CPU of one call (threads taking the GIL from one another on
        2 cores), so loads now go 8 MiB (256 blocks) a call.
        Large blocks (512 KiB and up) and stores with `fsync: always` (whose
        fdatasyncs overlap only across calls) spread a job over up to
        `io_concurrency` calls, where the depth matters: stores of at most MAX_CHUNK
        blocks a call; loads of up to LARGE_LOAD_BYTES a call (a 128-block load of 1 MiB
        blocks: 8 calls of 16, not 32 of 4), since each thread call costs the event
        loop more than a 512 KiB block's copy."""
        spread = min(MAX_CHUNK, max(1, -(-pairs // self.config.io_concurrency)))
        if verb == "store" and self.config.fsync == "always":
            return spread
        block = self.primary.block_bytes
        large = max(spread, min(MAX_CHUNK, CHUNK_BYTES // block))
        if block >= SMALL_BLOCK_BYTES:
            if verb == "load":  # spread over io_concurrency calls of LARGE_LOAD_BYTES at most
                share = -(-pairs // self.config.io_concurrency)
                return max(large, min(share, LARGE_LOAD_BYTES // block))
            return large
        return max(large, min(MAX_SMALL_CHUNK[verb], SMALL_CHUNK_BYTES[verb] // block))

    async def _claim_for_write(self, key: OffloadKey) -> bool:
        """Wait out any write or delete of `key` in flight; then True when this store
        must write it (and it is now marked being written), False when it is held
        already (same key, same bytes: refreshed instead of rewritten)."""
        while True:
            if key in self._index:
                self._index.move_to_end(key)
                return False
            if key in self._writing:
                pending = self._writing[key]
                if pending is None:
                    pending = self._writing[key] = anyio.Event()
            else:
                pending = self._deleting.get(key)
            if pending is None:
                self._writing[key] = None
                return True
            await pending.wait()

    async def _store_chunk(
        self, chunk: Batch, written: list[OffloadKey], deadline: float
    ) -> dict[OffloadKey, str]:
        """Write one chunk of a store job; the keys written are pinned and added to
        `written` (the job unpins them when it ends), so that a later chunk of the same
        job, making room, evicts other blocks or fails rather than evict these. A block
        not started by `deadline` is not written (`_in_chunks`)."""
        failed: dict[OffloadKey, str] = {}
        capacity = int(self.config.capacity)
        claimed: list[tuple[OffloadKey, int, int]] = []  # key, slot, footprint
        index, writing, deleting = self._index, self._writing, self._deleting
        try:
            for key, slot in chunk:  # per block: kept short, the common cases inline
                footprint = self.footprint(key)
                if footprint > capacity:
                    failed[key] = (
                        f"a block takes {format_size(footprint)} on disk, more than the "
                        f"nvme capacity of {format_size(capacity)}; raise `capacity`"
                    )
                elif key in index:  # held already (same key, same bytes): refreshed
                    index.move_to_end(key)
                elif key not in writing and key not in deleting:
                    writing[key] = None
                    claimed.append((key, slot, footprint))
                elif await self._claim_for_write(key):
                    claimed.append((key, slot, footprint))
            if not claimed:
                return failed
            async with self._io_slots:
                writes: list[tuple[OffloadKey, int, int]] = []
                victims: list[OffloadKey] = []
                needed = sum(footprint for _key, _slot, footprint in claimed)
                if self._used + self._reserved + needed <= capacity:  # fits: none evicted
                    self._reserved += needed
                    writes = claimed
                else:
                    for key, slot, footprint in claimed:
                        evicted = self._make_room(footprint)
                        if evicted is None:
                            failed[key] = (
                                f"{NO_ROOM}: the nvme capacity of {format_size(capacity)} "
                                "is taken by blocks being read, written or claimed by "
                                "lookups; retry later or raise `capacity`"
                            )
                            continue
                        victims += evicted
                        self._reserved += footprint
                        writes.append((key, slot, footprint))
                generation = self._generation
                places = self._take_places(len(writes))
                self._calls += 1
                try:
                    outcomes = await self._write_chunk(
                        [key for key, _slot, _footprint in writes],
                        [slot for _key, slot, _footprint in writes],
                        victims,
                        places,
                        deadline,
                    )
                finally:
                    self._calls -= 1
                    self._reserved -= sum(footprint for _, _, footprint in writes)
                    self._finish_deleting(victims)
                    self.report_removed(victims)
            written_ns = time.time_ns()
            if generation != self._generation:  # written into a directory now gone
                gone = FileNotFoundError(errno.ENOENT, "the tier's directory was removed")
                outcomes = [error or gone for error in outcomes]
            for i, ((key, _slot, footprint), error) in enumerate(zip(writes, outcomes)):
                if error is None:
                    self._index[key] = _Entry(footprint, written_ns, places[i] if places else -1)
                    self._used += footprint
                    self._block_footprint = footprint
                    self._pins[key] = self._pins.get(key, 0) + 1
                    written.append(key)
                else:
                    failed[key] = self._describe_error(error, "write", key)
                    if places:
                        self._give_back(places[i], generation)
            return failed
        finally:
            for key, _slot, _footprint in claimed:
                waited = self._writing.pop(key)
                if waited is not None:
                    waited.set()

    def _take_places(self, count: int) -> Sequence[int] | None:
        """Where `count` blocks about to be written go, when the key does not say (the
        slab layout's free slots); None for files named by their keys."""
        return None

    def _give_back(self, place: int, generation: int) -> None:
        """A place `_take_places` gave whose write failed (the slab layout frees it)."""

    def _dropped(self, entries: Sequence[tuple[OffloadKey, _Entry]]) -> None:
        """Blocks that left the index and whose medium is done with them (deleted, or
        found gone or corrupt): the slab layout frees their slots. Files: nothing."""

    async def _write_chunk(
        self,
        keys: list[OffloadKey],
        slots: list[int],
        victims: list[OffloadKey],
        places: Sequence[int] | None,
        deadline: float,
    ) -> list[Exception | None]:
        """A chunk's writes, waited for whole even if the caller is cancelled (the index
        must agree with the disk): on the core's queue when they are one call of the
        core (`_write_call`) and the queue serves this loop, else in a block thread
        (`_write_files`)."""
        return await self._on_core_or_thread(
            self._write_call, self._write_files, keys, slots, victims, places, deadline
        )

    async def _read_chunk(
        self,
        keys: list[OffloadKey],
        slots: list[int],
        touch: bytes,
        entries: Sequence[_Entry],
        deadline: float,
    ) -> list[Exception | None]:
        """A chunk's reads, as `_write_chunk`'s (`_read_call`, `_read_files`);
        `entries`: each key's index entry."""
        return await self._on_core_or_thread(
            self._read_call, self._read_files, keys, slots, touch, entries, deadline
        )

    async def _on_core_or_thread(
        self,
        call_of: Callable[..., native.CoreCall | None],
        in_thread: Callable[..., list[Exception | None]],
        *args: Any,
    ) -> list[Exception | None]:
        """`call_of(*args)` on the core's queue when it makes one call of the core and
        the queue serves this loop, else `in_thread(*args)` in a block thread; either
        way waited for whole, even if the caller is cancelled."""
        queue = self._queue
        if queue is not None and queue.serves():
            call = call_of(*args)
            if call is not None:
                return await queue.run(call)
        return await self._threads.run(in_thread, *args, shield=True)

    def _write_call(
        self,
        keys: list[OffloadKey],
        slots: list[int],
        victims: list[OffloadKey],
        places: Sequence[int] | None,
        deadline: float,
    ) -> native.CoreCall | None:
        """The chunk's writes as one call of the core for its queue, or None: files
        go in one batch call, unless victims' files are to be deleted first (the block
        thread does both in one hop)."""
        return None if victims else self._batch_write_call(keys, slots, deadline)

    def _read_call(
        self,
        keys: list[OffloadKey],
        slots: list[int],
        touch: bytes,
        entries: Sequence[_Entry],
        deadline: float,
    ) -> native.CoreCall | None:
        """The chunk's reads as one call of the core for its queue, or None."""
        return self._batch_read_call(keys, slots, touch, deadline)

    def _batch_write_call(
        self, keys: list[OffloadKey], slots: list[int], deadline: float
    ) -> native.CoreCall | None:
        """The chunk as one batch call of the core (`native.write_batch_call`), or None
        where it is not one (no one geometry of the primary's slots, long keys)."""
        lanes = self._lanes
        if lanes is None or not native.batch_keys(keys):
            return None
        return native.write_batch_call(
            self._root_fd,
            keys,
            slots,
            self.primary,
            lanes,
            self.framer,
            fsync=self.config.fsync == "always",
            threads=self._core_threads(len(keys)),
            deadline=deadline,
        )

    def _batch_read_call(
        self, keys: list[OffloadKey], slots: list[int], touch: bytes, deadline: float
    ) -> native.CoreCall | None:
        """The chunk's reads as one batch call (`native.read_batch_call`), or None."""
        lanes = self._lanes
        if lanes is None or not native.batch_keys(keys):
            return None
        return native.read_batch_call(
            self._root_fd,
            keys,
            slots,
            self.primary,
            lanes,
            touch,
            self.framer,
            threads=self._core_threads(len(keys)),
            deadline=deadline,
        )

    def _write_files(
        self,
        keys: list[OffloadKey],
        slots: list[int],
        victims: list[OffloadKey],
        places: Sequence[int] | None,
        deadline: float = 0.0,
    ) -> list[Exception | None]:
        """Worker thread: delete `victims`, then write each block (keys[i] from
        slots[i]); one outcome each. The whole chunk is one call of the compiled core
        when it is the engine: a batch call when the geometry allows (`_lanes`).
        `places`: `_take_places`' (None here). A block not started by `deadline`
        (`time.monotonic()`; 0: none) is `PastDeadline`, its slot not read."""
        fsync = self.config.fsync == "always"
        outcomes: list[Exception | None] = []
        with self._dirs.leaves() as leaves:
            if victims:
                blockfile.delete_files(leaves, [self.rel_of(v) for v in victims])
            call = self._batch_write_call(keys, slots, deadline)
            if call is not None:
                return call.run()
            slot_payload = self.primary.payload
            items = [(self.rel_of(k), k, slot_payload(s)) for k, s in zip(keys, slots)]
            if self._io_engine == "native":
                return native.write_blocks(
                    leaves, items, self.framer, fsync=fsync, deadline=deadline
                )
            for rel, key, payload in items:
                if blockfile.past(deadline):
                    outcomes.append(blockfile.PastDeadline("/".join(rel)))
                    continue
                try:
                    blockfile.write_block(leaves, rel, key, payload, self.framer, fsync=fsync)
                except Exception as exc:  # reported per key by the caller
                    outcomes.append(detached(exc))
                else:
                    outcomes.append(None)
        return outcomes

    def _delete_files(self, rels: list[RelPath]) -> int:
        """Worker thread: delete the files `rels` (`blockfile.delete_files`)."""
        with self._dirs.leaves() as leaves:
            return blockfile.delete_files(leaves, rels)

    def _delete_blocks(self, entries: list[tuple[OffloadKey, _Entry]]) -> None:
        """Worker thread: delete the blocks of `entries` (already out of the index)
        from the medium: their files here."""
        self._delete_files([self.rel_of(key) for key, _entry in entries])

    def _make_room(self, footprint: int) -> list[OffloadKey] | None:
        """Evict least recently used blocks neither pinned nor claimed until `footprint`
        more bytes fit.

        Returns the evicted keys (their files are still to be deleted, and they are
        marked deleting until then), or None, evicting nothing, when even evicting
        every other block would not make room."""
        excess = self._used + self._reserved + footprint - int(self.config.capacity)
        if excess <= 0:
            return []
        victims: list[OffloadKey] = []
        freed = 0
        for key, entry in self._index.items():  # oldest first
            if freed >= excess:
                break
            if self._pins.get(key) or self.claims.is_protected(key):
                continue
            victims.append(key)
            freed += entry.footprint
        if freed < excess:
            return None
        for key in victims:
            entry = self._index.pop(key)
            self._used -= entry.footprint
            self._deleting[key] = anyio.Event()
            self._evicted(entry)
        return victims

    def _evicted(self, entry: _Entry) -> None:
        """A block `_make_room` took (never one being read): the slab layout frees
        its slot for the write that made room. Files: deleted by that write's call."""

    def _unpin(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            pins = self._pins[key] - 1
            if pins:
                self._pins[key] = pins
            else:
                del self._pins[key]

    def _finish_deleting(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            event = self._deleting.pop(key, None)
            if event is not None:
                event.set()

    async def _load_chunk(self, chunk: Batch, deadline: float) -> dict[OffloadKey, str]:
        """Read one chunk of a load job. Its bookkeeping runs on the event loop, which
        serves every core thread: per block it is kept to C-level passes over the
        chunk (`map`) where the common case allows (a 128-page SGLang load is 128
        blocks; its loop time bounds a many-core machine, `nvme_engines.py`)."""
        failed: dict[OffloadKey, str] = {}
        index, pins = self._index, self._pins
        keys: list[OffloadKey] = list(map(_FIRST, chunk))
        entries: list[_Entry] = list(map(index.get, keys))  # type: ignore[arg-type]
        if None in entries:  # not held: those fail, the others are read
            held = [(pair, entry) for pair, entry in zip(chunk, entries) if entry is not None]
            failed = {
                key: "not in the nvme tier"
                for (key, _slot), entry in zip(chunk, entries)
                if entry is None
            }
            if not held:
                return failed
            keys = [key for (key, _slot), _entry in held]
            slots = [slot for (_key, slot), _entry in held]
            entries = [entry for _pair, entry in held]
        else:
            slots = list(map(_SECOND, chunk))
        deque(map(index.move_to_end, keys), maxlen=0)
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        now = time.time_ns()
        stale = now - blockfile.TOUCH_AFTER_NS
        if min(map(_TOUCHED, entries)) < stale:  # some to touch (else none: one C pass)
            touch = bytes(entry.touched_ns < stale for entry in entries)
        else:
            touch = bytes(len(entries))
        try:
            async with self._io_slots:
                self._calls += 1
                try:
                    outcomes = await self._read_chunk(keys, slots, touch, entries, deadline)
                finally:
                    self._calls -= 1
        finally:
            self._unpin(keys)
        if not any(outcomes):  # every block read: the common case
            if any(map(_READ_ERRORS, entries)):
                for entry in entries:
                    entry.read_errors = 0
            if any(touch):
                for entry, flag in zip(entries, touch):
                    if flag:
                        entry.touched_ns = now
            return failed
        unreadable: list[tuple[OffloadKey, _Entry]] = []
        forgotten: list[tuple[OffloadKey, _Entry]] = []
        for key, entry, error in zip(keys, entries, outcomes):
            if error is None:
                if entry.read_errors:
                    entry.read_errors = 0
                if entry.touched_ns < stale:
                    entry.touched_ns = now
                continue
            failed[key] = self._describe_error(error, "read", key)
            if isinstance(error, blockfile.PastDeadline):
                continue  # not read at all: the block is as good as before
            if not isinstance(error, (CorruptBlock, FileNotFoundError)):
                # an OS error may pass (EIO on a busy device, a link someone put
                # there): the block stays until it fails READ_ERRORS_BEFORE_DELETE
                # reads in a row; the cache does not believe this tier's claim
                # meanwhile (its job failed), so nothing loops on it
                entry.read_errors += 1
                if entry.read_errors < READ_ERRORS_BEFORE_DELETE:
                    failed[key] += (
                        f" (block kept: {entry.read_errors} of {READ_ERRORS_BEFORE_DELETE} "
                        "failed reads in a row before it is deleted)"
                    )
                    continue
                failed[key] += f" (block deleted after {READ_ERRORS_BEFORE_DELETE} failed reads)"
            # given up: the claim goes; a corrupt file was deleted by the read itself, a
            # missing one is gone, an unreadable one is deleted here (or it would take
            # disk space nothing counts)
            if self._forget(key, entry):
                forgotten.append((key, entry))
                if not isinstance(error, (CorruptBlock, FileNotFoundError)):
                    self._deleting[key] = anyio.Event()
                    unreadable.append((key, entry))
        try:
            if unreadable:
                try:
                    await self._threads.run(self._delete_blocks, unreadable, shield=True)
                finally:
                    self._finish_deleting([key for key, _entry in unreadable])
        finally:
            if forgotten:
                self._dropped(forgotten)
                self.report_removed([key for key, _entry in forgotten])
        return failed

    def _read_files(
        self,
        keys: list[OffloadKey],
        slots: list[int],
        touch: bytes,
        entries: Sequence[_Entry],
        deadline: float = 0.0,
    ) -> list[Exception | None]:
        """Worker thread: read and check each block (keys[i] into slots[i], its mtime
        refreshed where touch[i]); one outcome each. The whole chunk is one call of the
        compiled core when it is the engine: a batch call when the geometry allows.
        `entries`: each key's index entry (where the slab layout finds the block). A
        block not started by `deadline` is `PastDeadline`, its slot not written."""
        call = self._batch_read_call(keys, slots, touch, deadline)
        if call is not None:
            return call.run()
        payload = self.primary.payload
        items = [(block_relpath(k), k, payload(s), bool(t)) for k, s, t in zip(keys, slots, touch)]
        read = native.read_blocks if self._io_engine == "native" else blockfile.read_blocks
        with self._dirs.leaves() as leaves:
            return read(leaves, items, self.framer, self.primary.placement, deadline=deadline)

    def _core_threads(self, blocks: int) -> int:
        """Threads of the core for one call of `blocks` blocks: one while other calls
        run beside it (they are the parallelism already; more threads than CPUs only
        switch), else `native.default_threads`. On the 2-core dev VM, 4 jobs of 128
        blocks at once (benchmarks/nvme_engines.py, 3 interleaved pairs, tmpfs), CPU
        per block with / without: 64 KiB stores 50-64 / 65-69 us, loads 28-32 / 32-34;
        16 KiB within the noise (stores 29-33 / 27-39, loads 15-16 / 14-18)."""
        return 1 if self._calls > 1 else native.default_threads(blocks)

    def _describe_error(self, error: Exception, action: str, key: OffloadKey) -> str:
        if isinstance(error, CorruptBlock):
            logger.warning("nvme tier: deleted corrupt block %s: %s", self.path_of(key), error)
            return f"corrupt block deleted: {error}"
        if isinstance(error, FileNotFoundError):
            return "block file is gone from the nvme tier (deleted outside tierkv?)"
        if isinstance(error, blockfile.PastDeadline):
            return (
                f"nvme {action} not started: job_timeout={self.config.job_timeout}s had "
                "passed (a slow or stalled disk)"
            )
        if isinstance(error, ValueError):  # a block this layout cannot hold (its key)
            return str(error)
        if isinstance(error, OSError):
            return self._io_error(error, action)
        logger.error("nvme tier: unexpected error on %s", key.hex(), exc_info=error)
        return f"unexpected {type(error).__name__}: {error}"

    def _forget(self, key: OffloadKey, entry: _Entry) -> bool:
        """Drop `key` from the index if `entry` is still its entry: a failed load must
        not leave the key claimed (the caller would re-promote it forever). Whether
        it did (then nothing else is writing or deleting the key's file)."""
        if self._index.get(key) is entry:
            del self._index[key]
            self._used -= entry.footprint
            return True
        return False

    def _io_error(self, exc: OSError, action: str) -> str:
        """One message per kind of error (so a job's result lists each cause once)
        that names the cause and the fix."""
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = f"the disk under {self.config.path} is full: free space or lower `capacity`"
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            fix = (
                f"tierkv may not {action} files under {self.config.path}: check the "
                "directory's owner, mode and mount options"
            )
        else:
            fix = f"I/O error under {self.config.path}"
        return f"nvme {action} failed: {reason} ({code}); {fix}"
