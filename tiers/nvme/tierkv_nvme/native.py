"""The door to the nvme tier's compiled batch I/O core (`_batchio.c`).

Why: on the Python path (`blockfile`) a block costs ~73 us of CPU for a handful of
system calls, the checksum and the frame, most of it the interpreter; moving 64 KiB
blocks it reached 0.7-0.9 GB/s where the same files in plain C went 3.4 GB/s. The core
does a whole batch per call with the GIL released, on a few threads of its own:
opens, one vectored read or write per block, fdatasync, rename, frame headers and
checksums, and hands back one outcome per block.

`write_blocks` and `read_blocks` are `blockfile.write_block` (per block, as
`NvmeTier._write_files` calls it) and `blockfile.read_blocks` with the same outcomes:
FileNotFoundError, OSError with the errno (ELOOP for a link, with `dirs.no_link`'s
message), `CorruptBlock` with the same message as the Python path (the frame checks
are the core's; the message of a failed header is the `Framer`'s own, asked again
for that block only), the same frames byte for byte, the same crash safety
(temporary file, rename; unlinked on failure), the same `O_NOFOLLOW` rule (every
file opened relative to its fan-out directory's descriptor from `leaves`), a corrupt
file deleted when its name still holds it, and the mtime refreshed when asked. New
files are created 0600.

Signed frames (a `Framer` with a MAC key, `mac_key_env`) are the core's too: it makes
and checks the MAC (keyed BLAKE3, `_blake3.c`, 16 or 8 chunks at once with AVX-512 or
AVX2) beside the checksum, from the key the `Framer`'s `MacKey` derived (`_frame`).

Every call takes `deadline` (`time.monotonic()` seconds; 0: none): a block the core
has not started by then is left untouched and answers `PastDeadline`, so a job past
its deadline stops within one block per thread instead of finishing its whole call
(`NvmeTier._in_chunks`).

Not built (no C compiler or no Python headers when the package was installed):
`AVAILABLE` is False and `reason` says why and how to fix it.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import anyio

from tierkv.contract.framing import MAX_KEY_BYTES, Framer, payload_length
from tierkv.tier import CorruptBlock, Lane, OffloadKey, PrimaryView, TierUnavailable, detached
from tierkv_nvme.blockfile import PastDeadline, ReadItem, RelPath, Slot
from tierkv_nvme.dirs import Leaves, no_link
from tierkv_nvme.layout import MAX_HEX_KEY_BYTES, block_relpath, temp_name
from tierkv_nvme.slabfile import SLAB_FILES, FoundSlot

_core: ModuleType | None
try:  # by name: "No module named ..." rather than a "partially initialized" package
    _core = importlib.import_module("tierkv_nvme._batchio")
except ImportError as exc:
    _core = None
    AVAILABLE = False
    reason = (
        f"the nvme tier's compiled core (tierkv_nvme._batchio) is not built ({exc}); "
        "install a C compiler and Python's headers (Debian/Ubuntu: `apt-get install gcc "
        "python3-dev`), then reinstall the package (`pip install -e tiers/nvme`)"
    )
else:
    AVAILABLE = True
    reason = "the compiled core (tierkv_nvme._batchio) is built"

ENGINES = ("auto", "native", "python")
CORRUPT_KINDS = {
    1: "short file",
    2: "long file",
    3: "magic",
    4: "version",
    5: "flags",
    6: "namespace",
    7: "key length",
    8: "key",
    9: "payload length",
    10: "checksum",
    11: "slab slot",
    12: "MAC",
}
"""The core's outcome codes for a frame that fails a check, by what failed."""
MAX_DEFAULT_THREADS = 2
"""Threads one call uses by default: the tier already runs `io_concurrency` calls at
once, so a call that spreads over more threads than this mostly takes CPUs from the
others (and a thread costs ~20 us to start)."""
MIN_BLOCKS_PER_THREAD = 4
"""Blocks a call gives each thread at least (fewer: fewer threads)."""


def choose(wanted: str) -> tuple[str, str]:
    """The engine a tier configured with `io_engine: wanted` uses, and why.

    `auto`: native when built, else python (signed frames too: the core signs).
    `native` that cannot be had raises TierUnavailable naming the reason and the fix."""
    if wanted == "python":
        return "python", "io_engine: python"
    if not AVAILABLE:
        if wanted == "native":
            raise TierUnavailable(f"nvme io_engine: native, but {reason}")
        return "python", reason
    return "native", f"io_engine: {wanted}; {reason}"


def default_threads(blocks: int) -> int:
    """Threads for a call of `blocks` blocks: MAX_DEFAULT_THREADS at most, one per
    MIN_BLOCKS_PER_THREAD blocks, no more than the CPUs this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_THREADS, cpus, blocks // MIN_BLOCKS_PER_THREAD))


def _frame(framer: Framer) -> int | tuple[int, bytes, bytes]:
    """What the core's calls take for `framer`'s frames: the namespace hash, and for a
    signing framer its derived MAC key and key id."""
    key = framer.mac_key
    if key is None:
        return framer.namespace_tag
    return (framer.namespace_tag, key.derived_key, key.key_id)


def checksum_bits() -> int:
    """The widest vectors the core's xxh3 checksum loop runs on with this CPU: 512
    (AVX-512), 256 (AVX2), 128 (SSE2) or 64 (plain words, other CPUs)."""
    return int(_core_or_raise().XXH3_VECTOR_BITS)


def blake3_lanes() -> int:
    """Chunks the core's keyed BLAKE3 (the frames' MAC) hashes at once on this CPU:
    16 with AVX-512, 8 with AVX2, 1 elsewhere."""
    return int(_core_or_raise().BLAKE3_LANES)


def _core_or_raise() -> ModuleType:
    if _core is None:
        raise RuntimeError(reason)
    return _core


def _os_error(code: int, rel: RelPath) -> Exception:
    """The OSError (FileNotFoundError, ... by errno) for the core's outcome -`code`;
    `PastDeadline` for a block the call did not start (ECANCELED: its deadline)."""
    where = "/".join(rel)
    if code == errno.ECANCELED:
        return PastDeadline(where)
    return no_link(OSError(code, os.strerror(code), where), where)


def write_blocks(
    leaves: Leaves,
    items: Sequence[tuple[RelPath, OffloadKey, Slot]],
    framer: Framer,
    *,
    fsync: bool,
    threads: int | None = None,
    deadline: float = 0.0,
) -> list[Exception | None]:
    """`blockfile.write_block` for each of `items` (rel, key, payload), one outcome
    each (None: published), the blocks spread over `threads` threads of the core."""
    core = _core_or_raise()
    outcomes: list[Exception | None] = [None] * len(items)
    batch: list[tuple[int, bytes, bytes, bytes, Slot]] = []
    where: list[int] = []
    for i, (rel, key, payload) in enumerate(items):
        if len(key) > MAX_KEY_BYTES:
            outcomes[i] = ValueError(f"key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
            continue
        try:
            leaf = leaves.get(rel[:-1], create=True)
        except OSError as exc:
            outcomes[i] = detached(exc)
            continue
        name = rel[-1]
        batch.append((leaf, os.fsencode(name), os.fsencode(temp_name(name)), bytes(key), payload))
        where.append(i)
    if batch:
        wanted = default_threads(len(batch)) if threads is None else threads
        codes = core.write_blocks(batch, _frame(framer), fsync, wanted, deadline)
        for i, code in zip(where, codes):
            if code:
                outcomes[i] = _os_error(-code, items[i][0])
    return outcomes


def read_blocks(
    leaves: Leaves,
    items: Sequence[ReadItem],
    framer: Framer,
    placement: tuple[int, int] = (1, 0),
    *,
    threads: int | None = None,
    deadline: float = 0.0,
) -> list[Exception | None]:
    """`blockfile.read_blocks` for `items` (rel, key, slot, touch): one outcome each
    (None: read and checked), the blocks spread over `threads` threads of the core.
    `placement` is accepted for the same signature: the core tests each slot's
    distance (`blockfile.SHORT_DISTANCE`) itself, which costs it nothing."""
    core = _core_or_raise()
    outcomes: list[Exception | None] = [None] * len(items)
    batch: list[tuple[int, bytes, bytes, Slot, bool]] = []
    where: list[int] = []
    for i, (rel, key, dest, touch) in enumerate(items):
        try:
            leaf = leaves.get(rel[:-1], create=False)
        except OSError as exc:
            outcomes[i] = detached(no_link(exc, "/".join(rel)))
            continue
        batch.append((leaf, os.fsencode(rel[-1]), bytes(key), dest, touch))
        where.append(i)
    if not batch:
        return outcomes
    wanted = default_threads(len(batch)) if threads is None else threads
    codes, details = core.read_blocks(batch, _frame(framer), wanted, deadline)
    for j, (i, code) in enumerate(zip(where, codes)):
        if code < 0:
            outcomes[i] = _os_error(-code, items[i][0])
        elif code > 0:
            got, head = details[j]
            _rel, key, dest, _touch = items[i]
            outcomes[i] = _corrupt(code, got, head, key, dest, framer)
    return outcomes


def batch_ready(dir_fd: int = -1) -> bool:
    """Whether the batch calls (`write_batch`, `read_batch`) can run here: the core is
    built and the kernel opens below a directory without following links (openat2,
    Linux 5.6+), tried on `dir_fd` when given. A kernel without it, or a seccomp filter
    that refuses it, keeps the tier on the per-block calls."""
    return _core is not None and bool(_core.beneath_works(dir_fd))


def batch_keys(keys: Sequence[OffloadKey]) -> bool:
    """Whether every key is named by its hex (1 to MAX_HEX_KEY_BYTES bytes), as the
    batch calls require (longer keys are named by their sha256: per-block calls)."""
    return not keys or (min(map(len, keys)) > 0 and max(map(len, keys)) <= MAX_HEX_KEY_BYTES)


def write_batch_call(
    root_fd: int,
    keys: list[bytes],
    slots: list[int],
    primary: PrimaryView,
    lanes: tuple[Lane, ...],
    framer: Framer,
    *,
    fsync: bool,
    threads: int | None = None,
    deadline: float = 0.0,
) -> CoreCall:
    """`write_blocks` for `keys[i]` from `slots[i]` of `primary` (whose geometry is
    `lanes`), as one call that names, addresses and frames every block in C: no Python
    per block but the outcome of a failed one. Files go below `root_fd` (the namespace
    directory) as `layout.block_relpath` names them, opened without following any link.
    Keys must pass `batch_keys`."""
    core = _core_or_raise()
    wanted = default_threads(len(keys)) if threads is None else threads
    args = (
        root_fd, keys, lanes, slots, primary.num_blocks, _frame(framer), fsync, wanted,
        deadline,
    )  # fmt: skip

    def answer(codes: list[int]) -> list[Exception | None]:
        if not any(codes):
            return [None] * len(keys)
        return [
            _os_error(-code, block_relpath(key)) if code else None for code, key in zip(codes, keys)
        ]

    return CoreCall(core.FILES_WRITE_BATCH, args, answer)


def read_batch_call(
    root_fd: int,
    keys: list[bytes],
    slots: list[int],
    primary: PrimaryView,
    lanes: tuple[Lane, ...],
    touch: bytes | None,
    framer: Framer,
    *,
    threads: int | None = None,
    deadline: float = 0.0,
) -> CoreCall:
    """`read_blocks` for `keys[i]` into `slots[i]` of `primary` (geometry `lanes`), as
    `write_batch_call` does writes; `touch`: None, or a flag per key (refresh its
    mtime)."""
    core = _core_or_raise()
    wanted = default_threads(len(keys)) if threads is None else threads
    args = (
        root_fd, keys, lanes, slots, primary.num_blocks, touch, _frame(framer), wanted,
        deadline,
    )  # fmt: skip

    def answer(raw: tuple[list[int], dict[int, tuple[int, bytes]]]) -> list[Exception | None]:
        codes, details = raw
        return _read_outcomes(
            codes, details, keys, lambda i: primary.payload(slots[i]), framer, block_relpath
        )

    return CoreCall(core.FILES_READ_BATCH, args, answer)


def write_batch(*args: Any, **kwargs: Any) -> list[Exception | None]:
    """`write_batch_call(...)` made in this thread."""
    return write_batch_call(*args, **kwargs).run()


def read_batch(*args: Any, **kwargs: Any) -> list[Exception | None]:
    """`read_batch_call(...)` made in this thread."""
    return read_batch_call(*args, **kwargs).run()


def _read_outcomes(
    codes: list[int],
    details: dict[int, tuple[int, bytes]],
    keys: Sequence[OffloadKey],
    dest_of: Callable[[int], Slot],
    framer: Framer,
    rel_of: Callable[[OffloadKey], RelPath] = lambda _key: ("slab",),
) -> list[Exception | None]:
    """A read call's outcomes: None per block read whole, the OSError of a failed
    system call (naming `rel_of(key)`), the CorruptBlock of a failed check (of the
    bytes now in `dest_of(i)`)."""
    if not any(codes):
        return [None] * len(keys)
    outcomes: list[Exception | None] = [None] * len(keys)
    for i, code in enumerate(codes):
        if code < 0:
            outcomes[i] = _os_error(-code, rel_of(keys[i]))
        elif code > 0:
            got, head = details[i]
            outcomes[i] = _corrupt(code, got, head, keys[i], dest_of(i), framer)
    return outcomes


@dataclass(frozen=True)
class CoreCall:
    """One call of the core (slab or files), its arguments checked and gathered: `run()` makes it
    in this thread, `CoreQueue.run` on the core's own threads from an event loop.
    `answer` turns the core's raw answer into one outcome per block."""

    kind: int
    args: tuple[Any, ...]
    answer: Callable[[Any], list[Exception | None]]

    @classmethod
    def answered(cls, outcomes: list[Exception | None]) -> CoreCall:
        """A call with nothing left for the core: every block's outcome is known."""
        return cls(ANSWERED, (), lambda _raw: outcomes)

    def run(self) -> list[Exception | None]:
        if self.kind == ANSWERED:
            return self.answer(None)
        core = _core_or_raise()
        return self.answer(getattr(core, _SLAB_CALLS[self.kind])(*self.args))


ANSWERED = -1
"""`CoreCall.kind` of a call answered without the core."""


_SLAB_CALLS = (
    "slab_write", "slab_read", "slab_write_items", "slab_read_items", "write_batch", "read_batch"
)  # fmt: skip
"""The core's entry points by kind (`_batchio.SLAB_WRITE` ... `FILES_READ_BATCH`)."""


def _write_answer(codes: list[int]) -> list[Exception | None]:
    if not any(codes):
        return [None] * len(codes)
    return [_os_error(-code, ("slab",)) if code else None for code in codes]


def slab_write_call(
    fds: tuple[int, ...],
    keys: list[bytes],
    slots: list[int],
    primary: PrimaryView,
    lanes: tuple[Lane, ...],
    framer: Framer,
    places: bytes,
    seqs: bytes,
    room: int,
    num_places: int,
    *,
    fsync: bool,
    threads: int | None = None,
    direct_fds: tuple[int, ...] = (),
    deadline: float = 0.0,
) -> CoreCall:
    """`slabfile.write_slots` for `keys[i]` from `slots[i]` of `primary` (geometry
    `lanes`) into slab slot `places[i]` of the files `fds` sealed with `seqs[i]` (both
    bytes of little-endian u64s), as one call of the core: no Python per block. One
    `fdatasync` per file written after the batch when `fsync`. Keys must pass
    `batch_keys`. `direct_fds`: the same files opened O_DIRECT (`slabfile.open_direct`),
    used when `direct_aligned(lanes)`; else, and where the filesystem refuses a direct
    write (EINVAL), the blocks go through `fds`."""
    core = _core_or_raise()
    wanted = default_threads(len(keys)) if threads is None else threads
    args = (
        fds, keys, lanes, slots, primary.num_blocks, places, seqs, room, num_places,
        _frame(framer), fsync, wanted, direct_fds, deadline,
    )  # fmt: skip
    return CoreCall(core.SLAB_WRITE, args, _write_answer)


def slab_read_call(
    fds: tuple[int, ...],
    keys: list[bytes],
    slots: list[int],
    primary: PrimaryView,
    lanes: tuple[Lane, ...],
    framer: Framer,
    places: bytes,
    seqs: bytes,
    room: int,
    num_places: int,
    *,
    threads: int | None = None,
    direct_fds: tuple[int, ...] = (),
    deadline: float = 0.0,
) -> CoreCall:
    """`slabfile.read_slots` for `keys[i]` into `slots[i]` of `primary` from slab slot
    `places[i]`, as one call of the core; `seqs`: b"" or a u64 per key, non-zero to
    refresh that slot's sequence once read. Outcomes as `read_batch`'s. `direct_fds`
    as `slab_write_call`'s: a direct read never writes past a block's memory (only
    whole, aligned pages go direct) and takes the whole header page into the core's
    own aligned buffer."""
    core = _core_or_raise()
    wanted = default_threads(len(keys)) if threads is None else threads
    args = (
        fds, keys, lanes, slots, primary.num_blocks, places, seqs, room, num_places,
        _frame(framer), wanted, direct_fds, deadline,
    )  # fmt: skip

    def answer(raw: tuple[list[int], dict[int, tuple[int, bytes]]]) -> list[Exception | None]:
        codes, details = raw
        return _read_outcomes(codes, details, keys, lambda i: primary.payload(slots[i]), framer)

    return CoreCall(core.SLAB_READ, args, answer)


def slab_write_items_call(
    fds: tuple[int, ...],
    items: Sequence[tuple[OffloadKey, Slot]],
    framer: Framer,
    places: bytes,
    seqs: bytes,
    room: int,
    num_places: int,
    *,
    fsync: bool,
    threads: int | None = None,
    direct_fds: tuple[int, ...] = (),
    deadline: float = 0.0,
) -> CoreCall:
    """`slab_write_call` for blocks lent one by one (a primary with no one geometry,
    such as LMCache's objects): (key, payload) each, payload a buffer or regions. Keys
    must fit a slot's header page (`slabfile.MAX_FRAME_HEADER`). With `direct_fds`,
    each block whose regions are whole, 4 KiB aligned pages goes O_DIRECT, the others
    buffered."""
    core = _core_or_raise()
    batch = [(-1, b"", b"", bytes(key), payload) for key, payload in items]
    wanted = default_threads(len(batch)) if threads is None else threads
    args = (
        fds, batch, places, seqs, room, num_places, _frame(framer), fsync, wanted,
        direct_fds, deadline,
    )  # fmt: skip
    return CoreCall(core.SLAB_WRITE_ITEMS, args, _write_answer)


def slab_read_items_call(
    fds: tuple[int, ...],
    items: Sequence[tuple[OffloadKey, Slot]],
    framer: Framer,
    places: bytes,
    seqs: bytes,
    room: int,
    num_places: int,
    *,
    threads: int | None = None,
    direct_fds: tuple[int, ...] = (),
    deadline: float = 0.0,
) -> CoreCall:
    """`slab_read_call` for blocks lent one by one: (key, dest) each. Outcomes as
    `slab_read_call`'s; `direct_fds` as `slab_write_items_call`'s."""
    core = _core_or_raise()
    batch = [(-1, b"", bytes(key), dest, False) for key, dest in items]
    wanted = default_threads(len(batch)) if threads is None else threads
    args = (
        fds, batch, places, seqs, room, num_places, _frame(framer), wanted, direct_fds,
        deadline,
    )  # fmt: skip
    keys = [key for key, _dest in items]

    def answer(raw: tuple[list[int], dict[int, tuple[int, bytes]]]) -> list[Exception | None]:
        codes, details = raw
        return _read_outcomes(codes, details, keys, lambda i: items[i][1], framer)

    return CoreCall(core.SLAB_READ_ITEMS, args, answer)


def slab_write(*args: Any, **kwargs: Any) -> list[Exception | None]:
    """`slab_write_call(...)` made in this thread."""
    return slab_write_call(*args, **kwargs).run()


def slab_read(*args: Any, **kwargs: Any) -> list[Exception | None]:
    """`slab_read_call(...)` made in this thread."""
    return slab_read_call(*args, **kwargs).run()


def slab_write_items(*args: Any, **kwargs: Any) -> list[Exception | None]:
    """`slab_write_items_call(...)` made in this thread."""
    return slab_write_items_call(*args, **kwargs).run()


def slab_read_items(*args: Any, **kwargs: Any) -> list[Exception | None]:
    """`slab_read_items_call(...)` made in this thread."""
    return slab_read_items_call(*args, **kwargs).run()


class CoreQueue:
    """Slab calls on the core's own threads, asked for and answered on the event loop.

    Why: through a Python worker thread a chunk's call needs the GIL twice on that
    thread (to start its Python and to hand its answer back), each time waiting for the
    busy event loop to let go of it; on the 2-core dev VM, 4 jobs of 128 16 KiB blocks
    at once waited a median 0.44 ms to start and 0.40 ms to be answered around a 0.63
    ms call, and the CPUs idled a quarter of the time. Here the loop parses the call
    (with the GIL, as the thread did), a thread of the core's runs it without ever
    taking the GIL, and the core's eventfd, watched by the loop (`add_reader`), says
    when answers are ready: the loop collects them all at once.

    One queue serves one asyncio event loop, the first it runs on (`serves`); a call
    from another loop, or a loop without `add_reader`, goes to a worker thread as
    before (the caller asks `serves` first). A call cannot be stopped once queued:
    cancelling its caller waits for it (as `BlockThreads` with `shield=True`), so no
    thread of the core touches a job's slots after the job ended."""

    def __init__(self, threads: int) -> None:
        self._core = _core_or_raise().CoreQueue(threads)
        self._fd = self._core.fileno()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refused = False
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._tickets = itertools.count()

    def serves(self) -> bool:
        """Whether calls from the running event loop may go through this queue: an
        asyncio loop with `add_reader`, the one the queue first ran on."""
        if self._refused:
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # another async backend
            return False
        if self._loop is None:
            try:
                loop.add_reader(self._fd, self._collect)
            except (NotImplementedError, ValueError, OSError):
                self._refused = True
                return False
            self._loop = loop
        return self._loop is loop

    @property
    def in_flight(self) -> int:
        """Calls queued or running, not yet answered."""
        return int(self._core.in_flight)

    async def run(self, call: CoreCall) -> list[Exception | None]:
        """Make `call` on the core's threads (the caller asked `serves()`): its outcomes.
        Bad arguments raise here, before anything is queued."""
        if call.kind == ANSWERED:
            return call.answer(None)
        loop = self._loop
        assert loop is not None, "CoreQueue.run before serves()"
        done: asyncio.Future[Any] = loop.create_future()
        ticket = next(self._tickets)
        self._core.submit(ticket, call.kind, call.args)
        self._waiting[ticket] = done
        with anyio.CancelScope(shield=True):  # it runs to its end: wait for it
            raw = await done
        return call.answer(raw)

    def _collect(self) -> None:
        """The event loop, the eventfd readable: answer every call that has run."""
        for ticket, raw in self._core.collect():
            done = self._waiting.pop(ticket, None)
            if done is None or done.done():
                continue
            if isinstance(raw, BaseException):
                done.set_exception(raw)
            else:
                done.set_result(raw)

    def close(self) -> None:
        """Stop watching the eventfd and let the threads finish what is queued (the
        tier's close, after its jobs drained). Idempotent."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = None
        self._refused = True
        self._core.close()
        for done in self._waiting.values():
            if not done.done():
                done.set_exception(RuntimeError("the nvme core's queue was closed"))
        self._waiting.clear()


def direct_aligned(lanes: tuple[Lane, ...]) -> bool:
    """Whether the slab calls move every block of this geometry with O_DIRECT (given
    `direct_fds`): each lane's start address, stride and size are 4 KiB multiples. The
    core applies the same test on every call; this is for saying so (`data_path`)."""
    return bool(_core_or_raise().direct_aligned(lanes))


def slab_scan(
    fd: int, index: int, room: int, framer: Framer, block_bytes: int, cold: bool = False
) -> tuple[list[FoundSlot], int]:
    """`slabfile.scan` in the core, the GIL released: one `pread` of a header page per
    slot, no Python per slot but the result's; on a cold disk SCAN_AHEAD header pages
    asked for ahead, as `slabfile.scan` does (`cold`: from the first slot). A signing
    tier's scan keeps only frames signed with its key id (as `Framer.parse_header`
    does); their MACs are checked when they are read."""
    found, bad = _core_or_raise().slab_scan(
        fd, index, SLAB_FILES, room, _frame(framer), block_bytes, cold
    )
    return [FoundSlot(place, seq, key) for place, seq, key in found], bad


def _corrupt(
    code: int, got: int, head: bytes, key: OffloadKey, dest: Slot, framer: Framer
) -> CorruptBlock:
    """The CorruptBlock the Python path raises for a frame the core found bad (`code`):
    its length message, or for a header or checksum the `Framer`'s own message."""
    expected = framer.header_bytes(key) + payload_length(dest)
    if code == 1:
        return CorruptBlock(f"file ended after {got} of {expected} bytes")
    if code == 2:
        return CorruptBlock(f"file is longer than a frame of this block ({expected} bytes)")
    if code == 11:
        return CorruptBlock(
            "slab slot holds no whole block (never written, torn by a crash, or freed)"
        )
    try:
        framer.check_frame(head, key, dest)
    except CorruptBlock as exc:
        return detached(exc)
    kind = CORRUPT_KINDS.get(code, f"code {code}")  # the slot changed since: still failed
    return CorruptBlock(f"frame check failed ({kind})")


def encode_header(framer: Framer, key: OffloadKey, payload: Slot) -> bytes:
    """The header the core writes before `payload`, signed when `framer` signs (for
    tests: byte-identical to `framer.encode_header`)."""
    return bytes(_core_or_raise().encode_header(_frame(framer), bytes(key), payload))


__all__ = [
    "AVAILABLE",
    "CORRUPT_KINDS",
    "ENGINES",
    "batch_keys",
    "batch_ready",
    "blake3_lanes",
    "choose",
    "default_threads",
    "direct_aligned",
    "encode_header",
    "read_batch",
    "read_blocks",
    "reason",
    "slab_read",
    "slab_read_items",
    "slab_scan",
    "slab_write",
    "slab_write_items",
    "write_batch",
    "write_blocks",
]
