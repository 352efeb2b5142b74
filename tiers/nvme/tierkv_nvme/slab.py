"""`nvme` with `layout: slab`: blocks in the fixed slots of a few files per namespace.

The tier is `NvmeTier` in every other respect (index, LRU, pins, claims, chunks,
quotas, the directory's lock and privacy, a directory removed under it); only where a
block lies differs: a slot of the slab files (`slabfile.SLAB_FILES` of them, slots
dealt round-robin so that concurrent writes take different files' locks), written in
place, instead of a file named by its key. The format, and why it is crash safe, are
in `slabfile`.

What the slots change:

- Capacity is a slot count, `capacity // slot_bytes` (a slot is the block rounded up
  to pages plus a header page), and each block's footprint is one slot. The files are
  sized to their slots at `open` (sparse: pages are allocated by the first write of a
  slot; a disk that fills fails those writes, per block, as for files).
- A store takes a free slot (most recently freed first, so a full tier rewrites the
  slots its evictions just freed); an evicted block's slot is free at once (it is never
  one being read: eviction passes over pinned keys), and is overwritten by the write
  that made the room. A removed block's slot is punched out first (`slabfile.release`),
  so it does not come back after a restart and its disk space is given back (an
  LMCache adapter's chains of several object sizes share one budget this way); a slot
  freed while a load still reads its block is held back until that load ends, so no
  write lands under a reader.
- Loads refresh recency across restarts by rewriting the slot's header page with a new
  sequence (as often as the file layout's mtime refresh: `blockfile.TOUCH_AFTER_NS`).
  The rebuild orders blocks by sequence and keeps the newest copy of a key.
- The compiled core moves a chunk in one call: `native.slab_write`/`slab_read` when
  the primary has one geometry (`PrimaryView.lanes`) and every key is at most 100
  bytes, with no Python per block; else `slab_write_items`/`slab_read_items`, the
  blocks' buffers handed over one by one (LMCache's lent objects). From the event
  loop the call goes to the core's own threads (`native.CoreQueue`), which never take
  the GIL; a loop the queue does not serve hands it to a block thread. The Python path
  (`slabfile.write_slots`/`read_slots`) is for `io_engine: python` and machines
  without the core. Each writes the same bytes, signed or not (`mac_key_env`).
- A key longer than a slot's header page holds (about 4 KiB) fails its store with a
  message naming `layout: files`.
- `direct: true` opens each slab file a second time with O_DIRECT
  (`slabfile.open_direct`) and hands those descriptors to the core, which moves a
  block through them when its memory is whole, 4 KiB aligned pages (per call for a
  primary's one geometry, per block for lent ones), else through the buffered ones.
  The buffered descriptors keep the superblock, the scan, punched holes and
  truncation; Linux keeps the two kinds coherent. `data_path` says which is used.
- Block files of the file layout found at `open` move into free slots
  (`tierkv_nvme.convert`): switching an existing directory to slabs keeps its blocks.
- Shrinking `capacity` evicts the blocks of the slots past the new end at `open`
  (`RecoveryReport.evicted_over_capacity`) and truncates the files; a slab file written
  for another block size or namespace (or torn in its first page) is started anew,
  logged.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import time
from array import array
from collections.abc import Callable, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

import anyio

from tierkv.contract.units import format_size
from tierkv.tier import (
    JobMetadata,
    JobResult,
    Lane,
    OffloadKey,
    PrimaryView,
    TierConfig,
    in_thread,
)
from tierkv_nvme import convert, native, slabfile
from tierkv_nvme.recovery import ScanResult
from tierkv_nvme.tier import NvmeTier, _Entry

logger = logging.getLogger(__name__)

_PLACE = attrgetter("place")  # of index entries, in C

DIRECT_THREADS = 8
"""Threads of the core per call with O_DIRECT (`direct: true`). A direct read or write
waits for the disk in its thread (no read-ahead, no write-back to hide it), so the
disk has as many requests in flight as there are threads, and threads waiting cost no
CPU: on the dev VM's virtio disk (4 jobs of 128 blocks at once, 2,048 blocks) cold
loads went 0.41 / 0.51 / 0.58 GB/s at 16 KiB and 0.83 / 0.87 / 1.00 at 64 KiB with 1 /
8 / 16 threads a call, stores 0.25 / 0.35 / 0.42 and 0.71 / 0.93 / 1.01."""


class _SlabScan(ScanResult):
    """A scan of the slab: the slots found (`blocks` stays empty)."""

    def __init__(self, slots: list[slabfile.FoundSlot], bad: int) -> None:
        super().__init__()
        self.slots = slots
        self.bad = bad


class _Places(list[int]):
    """The slots a chunk's writes go to, and their sequences (taken on the event
    loop, so that blocks stored in one order are sealed in that order)."""

    seqs = array("Q")


class SlabNvmeTier(NvmeTier):
    """Blocks in the slots of `<path>/<namespace>/slots-NN.kvslab`, LRU-evicted past
    `capacity // slot_bytes` slots."""

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        super().__init__(config, primary)
        self._room = slabfile.room_for(primary.block_bytes)
        self._slot_bytes = self._room + slabfile.PAGE
        self._places = int(self.config.capacity) // self._slot_bytes
        self._slab_fds: tuple[int, ...] = ()
        self._direct_fds: tuple[int, ...] = ()
        """The slab files opened O_DIRECT (`direct: true`), one per `_slab_fds`; empty:
        every block buffered (not asked for, or the filesystem refuses it)."""
        self._direct_refused = ""  # why O_DIRECT could not be opened (logged once)
        self._direct_memory = False
        """Whether the primary's blocks may go direct (its one geometry is whole aligned
        pages, or its blocks are lent and checked one by one): set by `open`."""
        self._retired_slabs: list[int] = []
        self._free: list[int] = []  # free slots, taken from the end
        self._held_back: dict[OffloadKey, list[int]] = {}
        """Slots freed while their key was still pinned by a load: free once unpinned."""
        self._seqs = itertools.count(1)
        """Write (and refresh) sequences: `next` is one step under the GIL, so worker
        threads take them without a lock."""
        self._over: list[OffloadKey] = []  # blocks past the slots `capacity` allows (open)
        self._reusable: set[int] = set()
        """Slots `evict` freed without punching them out, kept for the next store to
        rewrite in place; what that store did not take is punched out when it ends."""

    @property
    def slab_paths(self) -> list[Path]:
        """The files that hold this tier's slots."""
        return [self.directory / slabfile.slab_name(i) for i in range(slabfile.SLAB_FILES)]

    @property
    def slots(self) -> int:
        """Slots the slab has (`capacity // slot_bytes`)."""
        return self._places

    def path_of(self, key: OffloadKey) -> Path:
        """The slab file that holds `key`'s slot (the first when it is not held)."""
        entry = self._index.get(key)
        index = slabfile.locate(entry.place, self._room)[0] if entry is not None else 0
        return self.directory / slabfile.slab_name(index)

    def footprint(self, key: OffloadKey) -> int:
        """One slot, whatever the key."""
        return self._slot_bytes

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "slots": self._places,
            "slot_bytes": self._slot_bytes,
            "direct": bool(self._direct_fds),
        }

    def chunk_size(self, pairs: int, verb: str) -> int:
        """Stores in chunks as large as loads': a slot's write creates no file for
        other threads to overlap, and `fsync: always` costs one `fdatasync` per file
        and chunk, so fewer, larger calls are cheaper either way."""
        return super().chunk_size(pairs, "load")

    def _core_threads(self, blocks: int) -> int:
        """With O_DIRECT, up to DIRECT_THREADS a call (MIN_BLOCKS_PER_THREAD blocks
        each at least), whatever runs beside it: its threads wait on the disk, not on
        the CPUs. Else `NvmeTier`'s."""
        if self._direct_fds and self._direct_memory:
            return max(1, min(DIRECT_THREADS, blocks // native.MIN_BLOCKS_PER_THREAD))
        return super()._core_threads(blocks)

    # -- life cycle ---------------------------------------------------------------
    async def open(self) -> None:
        await super().open()
        if self._io_engine == "native" and self._queue is None:  # lent blocks too
            self._queue = native.CoreQueue(self.config.io_concurrency)
        self._direct_memory = bool(self._direct_fds) and (
            self._lanes is None or native.direct_aligned(self._lanes)
        )
        if self.config.direct:
            self.data_path = self._direct_path(self.data_path or self._io_engine)
            logger.info("nvme tier %s: data path %s", self.directory, self.data_path)

    def _direct_path(self, engine: str) -> str:
        """`data_path` with `direct: true`: the engine and whether O_DIRECT moves the
        blocks, or why not (a user who asked for it sees that it is not in use)."""
        if self._direct_fds and self._lanes is None:
            return f"{engine}, O_DIRECT where a block's memory is 4 KiB aligned"
        if self._direct_fds and self._direct_memory:
            return f"{engine}, O_DIRECT"
        if self._direct_fds:
            why = "the primary's blocks are not whole 4 KiB aligned pages"
        elif self._io_engine != "native":
            why = native.choose(self.config.io_engine)[1]
        else:
            why = self._direct_refused or "not opened"
        return f"{engine}, buffered (direct unused: {why})"

    def _batch_lanes(self) -> tuple[Lane, ...] | None:
        """The slab calls need no `openat2`: the slab files' descriptors stay open."""
        return self.primary.lanes if self._io_engine == "native" else None

    def _take_directory(self) -> int:
        fs_block = super()._take_directory()
        fds: list[int] = []
        direct: list[int] = []
        try:
            for index in range(slabfile.SLAB_FILES):
                fds.append(self._open_slab(index))
            if self.config.direct and self._io_engine == "native":
                direct = self._open_direct(fds)
        except BaseException:  # give back what was just taken (not the retired ones)
            for fd in (*fds, *direct):
                os.close(fd)
            assert self._lock_fd is not None
            os.close(self._lock_fd)
            self._dirs.close()
            os.close(self._root_fd)
            self._lock_fd, self._root_fd = None, -1
            raise
        self._slab_fds = tuple(fds)
        self._direct_fds = tuple(direct)
        return fs_block

    def _open_direct(self, fds: list[int]) -> list[int]:
        """The slab files `fds` opened again with O_DIRECT; none (logged once) where
        the filesystem refuses it, so the tier stays buffered rather than failing."""
        direct: list[int] = []
        try:
            for index, fd in enumerate(fds):
                direct.append(slabfile.open_direct(fd, index, self._root_fd))
        except OSError as exc:
            for fd in direct:
                os.close(fd)
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            why = f"the filesystem refuses O_DIRECT ({exc.strerror})"
            if not self._direct_refused:
                logger.warning("nvme tier %s: direct: true, but %s: buffered", self.directory, why)
            self._direct_refused = why
            return []
        return direct

    def _open_slab(self, index: int) -> int:
        """Open (or create) slab file `index` below the namespace directory, without
        following a link; start it anew when its superblock is not this tier's
        (logged)."""
        fd = os.open(
            slabfile.slab_name(index),
            os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
            0o600,
            dir_fd=self._root_fd,
        )
        try:
            tag = self.framer.namespace_tag
            block = self.primary.block_bytes
            want = slabfile.superblock(index, block, self._room, tag)
            page = os.pread(fd, slabfile.PAGE, 0)
            problem = slabfile.superblock_problem(page, index, block, self._room, tag)
            if problem:
                if page:
                    logger.warning(
                        "nvme tier: %s is started anew (its %s of slots dropped): %s",
                        self.directory / slabfile.slab_name(index),
                        format_size(os.fstat(fd).st_size),
                        problem,
                    )
                os.ftruncate(fd, 0)
                os.pwrite(fd, want, 0)
            # no read-ahead: neighbouring slots are other blocks (a cold 64 KiB load
            # read 4-5x its bytes with the disk's 8 MiB read_ahead_kb); loads advise
            # the slots they read themselves (WILLNEED)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _release_lock(self) -> None:
        for fd in (*self._slab_fds, *self._direct_fds, *self._retired_slabs):
            os.close(fd)
        self._slab_fds = self._direct_fds = ()
        self._retired_slabs.clear()
        super()._release_lock()

    async def _retake(self) -> None:
        """The directory vanished: the slab went with it (its descriptors are retired,
        as the directory's are: a worker thread may still use them). Every slot is free
        from now, as the index is empty (writes still in flight go to the old files and
        are not given back: `_give_back` checks the generation); until the new files
        are open, reads and writes fail per key (`_no_slab`)."""
        self._retired_slabs.extend((*self._slab_fds, *self._direct_fds))
        self._slab_fds = self._direct_fds = ()
        held = sum(len(places) for places in self._held_back.values())
        self._reserved -= held * self._slot_bytes
        self._held_back.clear()
        self._reusable.clear()
        self._free = list(range(self._places - 1, -1, -1))
        await super()._retake()
        await in_thread(self._size_slab)

    async def _scan(self) -> ScanResult:
        found = _SlabScan([], 0)
        scan = native.slab_scan if self._io_engine == "native" else slabfile.scan
        # the files side by side (a cold disk gets every file's reads at once); the
        # Python path's scan holds the GIL between reads: one file at a time
        limiter = anyio.CapacityLimiter(
            self.config.io_concurrency if self._io_engine == "native" else 1
        )
        per_file: list[tuple[list[slabfile.FoundSlot], int]] = [([], 0)] * len(self._slab_fds)
        failed: list[Exception] = []  # raised as they are (open names an OSError), not
        # wrapped in the task group's ExceptionGroup

        async def scan_file(index: int, fd: int) -> None:
            try:
                per_file[index] = await in_thread(
                    scan,
                    fd,
                    index,
                    self._room,
                    self.framer,
                    self.primary.block_bytes,
                    limiter=limiter,
                )
            except Exception as exc:
                failed.append(exc)

        async with anyio.create_task_group() as group:
            for index, fd in enumerate(self._slab_fds):
                group.start_soon(scan_file, index, fd)
        if failed:
            raise failed[0]
        for slots, bad in per_file:
            found.slots += slots
            found.bad += bad
        taken = {slot.place for slot in found.slots}
        free = [p for p in range(self._places - 1, -1, -1) if p not in taken]
        moved, files = await in_thread(
            convert.files_into_slots,
            self.directory,
            self._slab_fds,
            self._room,
            self.framer,
            self.primary.block_bytes,
            free,
            max((slot.seq for slot in found.slots), default=0) + 1,
            self.config.fsync == "always",
        )
        found.merge(files)
        found.blocks.clear()  # the files' blocks are slots now (or were evicted)
        found.slots += moved
        return found

    def _rebuild(self, scan: ScanResult) -> None:
        """Index the slots found, oldest sequence first (the LRU end); of a key found
        twice the newest copy; blocks of slots past the slab's new end are evicted
        (`_enforce_capacity`)."""
        assert isinstance(scan, _SlabScan)
        self._index.clear()
        self._used = 0
        self._over = []
        newest: dict[OffloadKey, slabfile.FoundSlot] = {}
        for found in scan.slots:
            held = newest.get(found.key)
            if held is None or found.seq > held.seq:
                newest[found.key] = found
        dropped = len(scan.slots) - len(newest)
        taken: set[int] = set()
        now = time.time_ns()  # a load refreshes a slot's sequence only once it is stale
        for found in sorted(newest.values(), key=lambda f: f.seq):
            if found.place >= self._places:
                self._over.append(found.key)
                continue
            self._index[found.key] = _Entry(self._slot_bytes, now, found.place)
            self._used += self._slot_bytes
            taken.add(found.place)
        self._free = [p for p in range(self._places - 1, -1, -1) if p not in taken]
        self._seqs = itertools.count(max((f.seq for f in scan.slots), default=0) + 1)
        if scan.bad or dropped:
            logger.warning(
                "nvme tier: %s: %d slots with a bad frame header and %d older copies of "
                "blocks stored again later are free",
                self.directory,
                scan.bad,
                dropped,
            )

    async def _enforce_capacity(self) -> int:
        """Size the slab to its slots (a shrunk `capacity` cuts the slots past the new
        end: their blocks are evicted)."""
        await in_thread(self._size_slab)
        over, self._over = self._over, []
        if over:
            self.report_removed(over)
        return len(over)

    def _size_slab(self) -> None:
        for index, fd in enumerate(self._slab_fds):
            os.ftruncate(fd, slabfile.file_bytes(self._places, index, self._room))

    # -- slots --------------------------------------------------------------------
    def _take_places(self, count: int) -> Sequence[int] | None:
        """`count` free slots: room was made by the caller (a slot per footprint), so
        they are there; the ones held back for readers are counted as reserved."""
        free = self._free
        if len(free) < count:  # cannot happen while the byte counts hold: say so loudly
            raise RuntimeError(f"slab of {self._places} slots: {count} wanted, {len(free)} free")
        taken = _Places(reversed(free[len(free) - count :]))
        del free[len(free) - count :]
        if self._reusable:
            self._reusable.difference_update(taken)
        taken.seqs = array("Q", itertools.islice(self._seqs, count))
        return taken

    def _give_back(self, place: int, generation: int) -> None:
        if generation == self._generation:  # else a slot of a slab now gone
            self._free.append(place)

    # -- eviction for a store of this tier (a shared budget's) -------------------
    async def evict(self, keys: Sequence[OffloadKey]) -> None:
        """Drop `keys` for the room of this tier's next store, their slots left as they
        are (not punched out): that store rewrites them in place, where a punched slot
        would have its pages (or extents) allocated anew. The slots the next store does
        not take are punched out when it ends (`_trim`), so the tier's bytes on the
        disk stay what its blocks take. Until a slot is rewritten its old block could
        come back after a crash, whole and checked, as an evicted slot's can."""
        self._check_open()
        async with self._inflight.job():
            targets = self._unindex(keys)
            self._reusable.update(entry.place for _key, entry in targets)
            self._dropped(targets)

    async def store(self, job: JobMetadata) -> JobResult:
        try:
            return await super().store(job)
        finally:
            if self._reusable:
                await self._trim()

    async def _trim(self) -> None:
        """Punch out the free slots `evict` kept that no store took (out of the free
        list meanwhile, counted as reserved, so no store takes one being punched)."""
        kept, self._reusable = self._reusable, set()
        punch = [place for place in self._free if place in kept]
        if not punch:
            return
        generation = self._generation
        self._free = [place for place in self._free if place not in kept]
        self._reserved += self._slot_bytes * len(punch)
        try:
            if self._slab_fds:
                await self._threads.run(
                    slabfile.release, self._slab_fds, punch, self._room, shield=True
                )
        except OSError as exc:  # the space stays used until the slots are written again
            logger.warning(
                "nvme tier: %s: punching out %d evicted slots failed: %s",
                self.directory,
                len(punch),
                exc,
            )
        finally:
            self._reserved -= self._slot_bytes * len(punch)
            if generation == self._generation:  # else the slab was made anew meanwhile
                self._free[:0] = punch  # taken last: the slots evictions leave come first

    def _evicted(self, entry: _Entry) -> None:
        self._free.append(entry.place)

    def _dropped(self, entries: Sequence[tuple[OffloadKey, _Entry]]) -> None:
        pins = self._pins
        for key, entry in entries:
            if pins.get(key):  # a load still reads it: free when it ends
                self._held_back.setdefault(key, []).append(entry.place)
                self._reserved += self._slot_bytes
            else:
                self._free.append(entry.place)

    def _unpin(self, keys: Sequence[OffloadKey]) -> None:
        super()._unpin(keys)
        held = self._held_back
        if held:
            for key in keys:
                if key in held and not self._pins.get(key):
                    places = held.pop(key)
                    self._free.extend(places)
                    self._reserved -= self._slot_bytes * len(places)

    # -- the medium ---------------------------------------------------------------
    def _write_call(
        self,
        keys: list[OffloadKey],
        slots: list[int],
        victims: list[OffloadKey],
        places: Sequence[int] | None,
        deadline: float,
    ) -> native.CoreCall | None:
        """The chunk (keys[i] from slots[i] into slab slot places[i]) as one call of the
        core: a batch call when the primary's slots have one geometry and the keys are
        short, else an items call (blocks lent one by one, LMCache's objects); the
        victims' slots are among `places`, nothing to delete. None on the Python path,
        or with no slab files open."""
        if not self._slab_fds or self._io_engine != "native":
            return None
        assert isinstance(places, _Places)
        fsync = self.config.fsync == "always"
        seqs = places.seqs
        lanes = self._lanes
        if lanes is not None and native.batch_keys(keys):
            return native.slab_write_call(
                self._slab_fds,
                keys,
                slots,
                self.primary,
                lanes,
                self.framer,
                array("Q", places).tobytes(),
                seqs.tobytes(),
                self._room,
                self._places,
                fsync=fsync,
                threads=self._core_threads(len(keys)),
                direct_fds=self._direct_fds,
                deadline=deadline,
            )
        payload = self.primary.payload
        return self._items_call(keys, lambda fit: native.slab_write_items_call(
            self._slab_fds, [(k, payload(slots[i])) for i, k in fit], self.framer,
            array("Q", [places[i] for i, _k in fit]).tobytes(),
            array("Q", [seqs[i] for i, _k in fit]).tobytes(), self._room, self._places,
            fsync=fsync, threads=self._core_threads(len(fit)), direct_fds=self._direct_fds,
            deadline=deadline,
        ))  # fmt: skip

    def _read_call(
        self,
        keys: list[OffloadKey],
        slots: list[int],
        touch: bytes,
        entries: Sequence[_Entry],
        deadline: float,
    ) -> native.CoreCall | None:
        """The chunk's reads as one call of the core (`_write_call`'s terms); a slot
        whose touch[i] is set gets a new sequence (its recency after a restart)."""
        if not self._slab_fds or self._io_engine != "native":
            return None
        seqs = b""
        if any(touch):
            fresh = array("Q", bytes(8 * len(keys)))
            for i, flag in enumerate(touch):
                if flag:
                    fresh[i] = next(self._seqs)
            seqs = fresh.tobytes()
        places = array("Q", map(_PLACE, entries))
        lanes = self._lanes
        if lanes is not None and native.batch_keys(keys):
            return native.slab_read_call(
                self._slab_fds,
                keys,
                slots,
                self.primary,
                lanes,
                self.framer,
                places.tobytes(),
                seqs,
                self._room,
                self._places,
                threads=self._core_threads(len(keys)),
                direct_fds=self._direct_fds,
                deadline=deadline,
            )
        payload = self.primary.payload
        fresh_seqs = array("Q", seqs) if seqs else None
        return self._items_call(keys, lambda fit: native.slab_read_items_call(
            self._slab_fds, [(k, payload(slots[i])) for i, k in fit], self.framer,
            array("Q", [places[i] for i, _k in fit]).tobytes(),
            array("Q", [fresh_seqs[i] for i, _k in fit]).tobytes() if fresh_seqs else b"",
            self._room, self._places, threads=self._core_threads(len(fit)),
            direct_fds=self._direct_fds, deadline=deadline,
        ))  # fmt: skip

    def _items_call(
        self,
        keys: Sequence[OffloadKey],
        build: Callable[[list[tuple[int, OffloadKey]]], native.CoreCall],
    ) -> native.CoreCall:
        """The core's items call `build(fit)` for the (index, key) of every key whose
        frame header fits a slot's header page, answering for all `keys`: the others
        fail, naming `layout: files` (`slabfile.seal`'s message)."""
        outcomes: list[Exception | None] = [None] * len(keys)
        fit: list[tuple[int, OffloadKey]] = []
        for i, key in enumerate(keys):
            if self.framer.header_bytes(key) > slabfile.MAX_FRAME_HEADER:
                try:
                    slabfile.seal(bytes(self.framer.header_bytes(key)), 0)
                except ValueError as exc:
                    outcomes[i] = exc
            else:
                fit.append((i, key))
        if not fit:
            return native.CoreCall.answered(outcomes)
        call = build(fit)

        def answer(raw: Any) -> list[Exception | None]:
            for (i, _key), outcome in zip(fit, call.answer(raw)):
                outcomes[i] = outcome
            return outcomes

        return native.CoreCall(call.kind, call.args, answer)

    def _write_files(
        self,
        keys: list[OffloadKey],
        slots: list[int],
        victims: list[OffloadKey],
        places: Sequence[int] | None,
        deadline: float = 0.0,
    ) -> list[Exception | None]:
        """Worker thread: write keys[i] from slots[i] into slab slot places[i] (the
        victims' slots are among them: nothing to delete); none started after
        `deadline` (`NvmeTier._write_files`)."""
        assert isinstance(places, _Places)
        if not self._slab_fds:
            return self._no_slab(keys)
        call = self._write_call(keys, slots, victims, places, deadline)
        if call is not None:
            return call.run()
        fsync = self.config.fsync == "always"
        seqs = places.seqs
        payload = self.primary.payload
        items = [(p, k, payload(s), q) for p, k, s, q in zip(places, keys, slots, seqs)]
        return slabfile.write_slots(
            self._slab_fds, items, self._room, self.framer, fsync=fsync, deadline=deadline
        )

    def _read_files(
        self,
        keys: list[OffloadKey],
        slots: list[int],
        touch: bytes,
        entries: Sequence[_Entry],
        deadline: float = 0.0,
    ) -> list[Exception | None]:
        """Worker thread: read keys[i] from its slot into slots[i]; a slot whose
        touch[i] is set gets a new sequence (its recency after a restart). None
        started after `deadline` (`NvmeTier._read_files`)."""
        if not self._slab_fds:
            return self._no_slab(keys)
        call = self._read_call(keys, slots, touch, entries, deadline)
        if call is not None:
            return call.run()
        places = list(map(_PLACE, entries))
        seqs = array("Q", bytes(8 * len(keys)))
        if any(touch):
            for i, flag in enumerate(touch):
                if flag:
                    seqs[i] = next(self._seqs)
        payload = self.primary.payload
        items = [(p, k, payload(s), q) for p, k, s, q in zip(places, keys, slots, seqs)]
        return slabfile.read_slots(
            self._slab_fds, items, self._room, self.framer, deadline=deadline
        )

    def _delete_blocks(self, entries: list[tuple[OffloadKey, _Entry]]) -> None:
        """Worker thread: release the slots (the blocks stay gone after a restart and
        their disk space is given back); the slots are freed by `_dropped` once this
        returns."""
        if self._slab_fds:  # else they went with the directory
            places = [entry.place for _key, entry in entries]
            slabfile.release(self._slab_fds, places, self._room)

    def _no_slab(self, keys: Sequence[OffloadKey]) -> list[Exception | None]:
        """Every key failed: the slab files are being made anew (`_retake`)."""
        gone = OSError(errno.EBADF, "the tier's directory is being made anew")
        return [gone] * len(keys)
