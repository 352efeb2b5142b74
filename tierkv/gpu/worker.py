"""The transfer worker: copies KV blocks between the engine's GPU KV caches and the
primary slab, in both directions, for every KV-cache group of a request in one
submission. The row layout is documented in `tierkv.gpu.geometry`.

**A transfer** (`TransferSpec`) names per group the GPU block ids in token order, the
primary slots of the offloaded blocks they fall in, and `block_indices[g]`: the
position of the first GPU block, of which only `% block_size_factor` matters. GPU block
`k` of group `g` goes to (or comes from) sub-block `(head + k) % factor` of slot
`slots[g][(head + k) // factor]`, with `head = block_indices[g] % factor`; so a
transfer may start and end inside an offloaded block, and the sub-blocks it does not
name are left alone. Several specs of one direction may form one submission (one copy,
one event). Every check runs before any byte moves.

**How bytes move.** A copy backend (`tierkv.gpu.backends`): DMA copy engines or
gather/scatter kernels, `copy_backend='auto'` picking per transfer. On the CPU device
(what most tests run) the copy happens inside `submit`. On CUDA each direction has its
own stream; a transfer first waits on the `ready` stream or event the engine gives
(per worker or per call: never "the current stream"), an event closes it
(`TransferHandle.done_event`, which the engine's stream may wait on), and transfers in
one direction complete in submission order. A task waiting on a short copy looks at
its event from the loop, between the loop's other tasks, for up to
`completion_poll_us`; a task that must sleep hands the copies in flight to its
direction's completion thread, which sleeps on their events and wakes it through
`loop.call_soon_threadsafe`. Nothing synchronises on the event loop thread.

**Off the loop.** `start` (which `transfer` and `KVCacheBlocks` use) checks a transfer
and orders it after `ready` on the calling thread, then plans and issues one of at
least `thread_min_pages` pages on its direction's submitter thread (an anyio worker
thread behind a one-slot limiter: call order kept), so the event loop is not held by
driver calls (10 ms for a 512-block load on an H200). `submit` issues on the caller's
thread. A lane lock keeps stream order and in-flight order the same when both are used.

Drive a worker from one event loop thread; the `ready` it is given may come from any
thread (the engine's).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch

from tierkv.contract.units import format_size
from tierkv.gpu.alias import DeviceView, require_pinned, uva_view
from tierkv.gpu.backends import CopyBackendName, DmaExecutorName
from tierkv.gpu.cuda_batch import MAX_COPIES_PER_CALL, BatchStats
from tierkv.gpu.geometry import check_layout
from tierkv.gpu.graphs import Slot
from tierkv.gpu.lanes import Lane, Launched, TransferHandle, new_lanes
from tierkv.gpu.mapping import Mapping, map_specs
from tierkv.gpu.options import Backends, WorkerOptions
from tierkv.gpu.spec import (
    Direction,
    TransferResult,
    TransferSpec,
    TransferSpecError,
)
from tierkv.gpu.streams import CudaStreams, ImmediateStreams, Streams
from tierkv.layout import KVLayout
from tierkv.primary import HostSlab

logger = logging.getLogger(__name__)


THREAD_MIN_PAGES = 256
"""Transfers of at least this many (block, layer) pages are planned and issued on the
direction's submitter thread, not on the event loop. On an H200 `submit` held the
loop ~0.6 us per page (a 512-block, 32-layer load: 9.8 ms, mostly driver calls, which
release the GIL); one block of 32 pages 177 us. Below this, the thread hop (tens of
us) costs more than it frees."""

COMPLETION_POLL_US = 200.0
"""How long a waiter on a short copy (fewer than `POLL_MAX_PAGES` pages) looks at it
from the event loop, once per pass of the loop's other ready tasks, before it hands the
copy to the completion thread and sleeps (sooner, after `START_WAIT_SECONDS`, when the
copy has not begun). The thread's wake-up (a driver wait, then
`call_soon_threadsafe`, then the loop resuming the task) cost a one-block load 55-75 us
after its copy had ended on an H100; a copy of a few blocks takes tens of microseconds.
A copy that outlasts the window costs the loop's thread this much extra CPU time."""

START_WAIT_SECONDS = 50e-6
"""A waiter looks at a short copy only while it runs: once this long has passed and
the copy has not begun on its stream (it waits behind `ready`, say a model step of
milliseconds, or an earlier copy), the waiter sleeps until the completion thread wakes
it instead of spending the loop's CPU (and the GIL) on looking."""

POLL_MAX_PAGES = 256
"""Copies of fewer (block, layer) pages are looked at from the loop first
(`COMPLETION_POLL_US`): 256 pages of 64 KiB take ~300 us on PCIe Gen5, longer than the
window; larger ones go straight to the completion thread."""

MAX_UNCLAIMED_RESULTS = 4096
"""Results of transfers nobody awaited kept for `get_finished` at most; older ones
are dropped (`TransferWorker.unclaimed_dropped`)."""


class TransferWorker:
    """Moves KV blocks between GPU KV caches and primary slots; see the module doc.

    `kv_caches[g]` are group `g`'s per-layer tensors (block index first), `primary` the
    primary slab (a `HostSlab` or its `[num_slots, block_bytes]` uint8 tensor, pinned
    when the KV caches are on CUDA), `layout` the cache's `KVLayout`, and
    `gpu_block_size` the engine's block size in tokens (one int, or one per group).
    `block_size_factor` is `layout.groups[g].block_size // gpu_block_size[g]` and must
    be the same for every group. Layout problems raise `ConfigError`, all at once.

    `copy_backend`: `auto` (default), `dma`, `bounded` or `kernel`
    (`tierkv.gpu.backends`); `bounded_programs`: the thread blocks of the `bounded`
    kernel in both directions (default: per direction,
    `tierkv.gpu.bounded.DEFAULT_PROGRAMS`).
    `ready` (CUDA): the engine stream or event every transfer waits on unless the call
    gives its own; on CUDA one of the two is required. `dma_executor`: how DMA copies
    are issued (`auto`: the batched memcpy when cuda-bindings has it, else `copy_` per
    run; `memmove` on CPU). `device_view(pinned_slab, device)` makes the slab's device
    alias for the kernel backend (default `uva_view`). `streams` replaces the device's
    streams and events (the tests' fake device). `max_copies_per_call`: copies per
    batched driver call at most (`tierkv.gpu.cuda_batch.MAX_COPIES_PER_CALL`).
    `thread_min_pages`: `start`, `transfer` and `KVCacheBlocks` issue a transfer of at
    least this many pages from the direction's submitter thread (`THREAD_MIN_PAGES`).
    `completion_poll_us`: how long a waiter on a short copy looks at it from the event
    loop before sleeping until the completion thread wakes it (`COMPLETION_POLL_US`;
    0: sleep at once).
    """

    def __init__(
        self,
        kv_caches: Sequence[Sequence[torch.Tensor]],
        primary: HostSlab | torch.Tensor,
        layout: KVLayout,
        *,
        gpu_block_size: int | Sequence[int],
        copy_backend: CopyBackendName = "auto",
        ready: Any = None,
        dma_executor: DmaExecutorName = "auto",
        device_view: DeviceView = uva_view,
        streams: Streams | None = None,
        max_copies_per_call: int = MAX_COPIES_PER_CALL,
        thread_min_pages: int = THREAD_MIN_PAGES,
        bounded_programs: int | None = None,
        completion_poll_us: float = COMPLETION_POLL_US,
    ) -> None:
        options = WorkerOptions(
            copy_backend=copy_backend,
            dma_executor=dma_executor,
            device_view=device_view,
            max_copies_per_call=max_copies_per_call,
            thread_min_pages=thread_min_pages,
            bounded_programs=bounded_programs,
            completion_poll_us=completion_poll_us,
        )
        self.thread_min_pages = thread_min_pages
        self._poll_seconds = completion_poll_us / 1e6
        self._poll_max_pages = POLL_MAX_PAGES if completion_poll_us > 0 else 0
        slab = primary.tensor if isinstance(primary, HostSlab) else primary
        groups, geometry = check_layout(kv_caches, slab, layout, gpu_block_size)
        assert isinstance(slab, torch.Tensor)
        self.geometry = geometry
        self.device: torch.device = groups[0][0].device
        self.copy_backend: CopyBackendName = copy_backend
        cuda = self.device.type == "cuda"
        if cuda:
            require_pinned(slab)
        self._streams: Streams = streams or (
            CudaStreams(self.device) if cuda else ImmediateStreams()
        )
        self._ready = ready
        self._slab = slab
        self._ids = itertools.count(1)
        # results nobody claimed, for get_finished; bounded, because a caller that
        # orders its work on done_event may never ask (the oldest go first, counted)
        self._finished: deque[TransferResult] = deque(maxlen=MAX_UNCLAIMED_RESULTS)
        self.unclaimed_dropped = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._progress: anyio.Event | None = None
        self._backends = Backends.build(groups, slab, geometry, self.device, options)
        self._lanes: dict[Direction, Lane] = new_lanes(self._streams, self._notify)
        logger.debug(
            "transfer worker on %s: %d groups, factor %d, block %s, pages %s, backend %s",
            self.device,
            geometry.num_groups,
            geometry.block_size_factor,
            format_size(geometry.block_bytes),
            geometry.page_bytes,
            copy_backend,
        )

    # -- geometry -----------------------------------------------------------------------
    @property
    def block_size_factor(self) -> int:
        return self.geometry.block_size_factor

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes

    @property
    def sub_block_stride(self) -> int:
        return self.geometry.sub_block_stride

    @property
    def page_bytes(self) -> tuple[tuple[int, ...], ...]:
        return self.geometry.page_bytes

    @property
    def num_gpu_blocks(self) -> tuple[int, ...]:
        return self.geometry.num_gpu_blocks

    @property
    def num_slots(self) -> int:
        return self.geometry.num_slots

    @property
    def num_groups(self) -> int:
        return self.geometry.num_groups

    def group_block_bytes(self, group: int) -> int:
        """Bytes of one GPU block of `group`, all layers: its share of a chunk."""
        return self.geometry.group_block_bytes(group)

    def byte_range(self, group: int, layer: int, sub_block: int) -> tuple[int, int]:
        """Where, within a slot's row, `layer` of sub-block `sub_block` of a `group`
        block lives: `[start, stop)` in bytes."""
        return self.geometry.byte_range(group, layer, sub_block)

    def serves(self, view: HostSlab | torch.Tensor) -> bool:
        """Whether this worker moves blocks to and from `view` (a `HostSlab`, or a
        `[num_slots, block_bytes]` tensor): the very slab it was built over, not just
        one of the same shape. A worker of another cache with the same geometry would
        copy into that cache's slots; callers that are handed a worker check this."""
        tensor = view.tensor if isinstance(view, HostSlab) else view
        return (
            tuple(tensor.shape) == (self.num_slots, self.block_bytes)
            and tensor.data_ptr() == self._slab.data_ptr()
        )

    @property
    def batch_stats(self) -> BatchStats | None:
        """Calls, copies and refused calls (redone by runs) of the batched memcpy; None
        where DMA copies are not batched (CPU, the kernel backend, no cuda-bindings)."""
        return self._backends.batch_stats

    @property
    def dma_executor(self) -> str | None:
        """How DMA copies are issued (`batched`, `runs`, `memmove`), None without DMA."""
        return self._backends.dma_executor

    # -- submitting ---------------------------------------------------------------------
    def _launch(self, mapping: Mapping, lane: Lane) -> Launched:
        """Start the copy of `mapping` on the lane's stream (ordered after `ready`
        by the caller)."""
        backend, plan = self._backends.pick(mapping)
        keep: list[object] = []

        def work(stream: Any) -> None:
            keep.extend(backend.enqueue(mapping, stream, plan))

        completion = self._streams.launch(lane.stream, work, current=backend.uses_current_stream)
        for item in keep:
            if isinstance(item, Slot):  # a replayed graph: its ids are read by this copy
                item.release(completion)
        return Launched(completion, tuple(keep), backend.name)

    def submit(
        self, spec: TransferSpec | Sequence[TransferSpec], *, ready: Any = None
    ) -> TransferHandle:
        """Check `spec` (or several specs of one direction: one submission) and start
        its copy (on CPU: do it). On CUDA the copy waits on `ready` (a stream or event;
        default: the worker's). Results that nobody awaits with `wait` are handed out by
        `get_finished`."""
        return self._submit(spec, ready, claimed=False)

    def _submit(
        self, spec: TransferSpec | Sequence[TransferSpec], ready: Any, *, claimed: bool
    ) -> TransferHandle:
        mapping, lane = self._prepare(spec, ready)
        handle = self._queue(mapping, lane, claimed)
        self._reap()
        return handle

    async def start(
        self, spec: TransferSpec | Sequence[TransferSpec], *, ready: Any = None
    ) -> TransferHandle:
        """`submit` without holding the event loop: a transfer of at least
        `thread_min_pages` pages is planned and issued on its direction's submitter
        thread while the loop serves other tasks. Returns once the copy is queued
        (`done_event` recorded). The checks run first, here: a bad spec raises before
        anything is queued. Once handed to the thread, the copy is queued even if the
        caller is cancelled; its result then goes to `get_finished`."""
        return await self._start(spec, ready, claimed=False)

    async def _start(
        self, spec: TransferSpec | Sequence[TransferSpec], ready: Any, *, claimed: bool
    ) -> TransferHandle:
        mapping, lane = self._prepare(spec, ready)
        if self.geometry.pages(mapping.gpu) < self.thread_min_pages:
            handle = self._queue(mapping, lane, claimed)
        else:
            if lane.submitter is None:
                lane.submitter = anyio.CapacityLimiter(1)  # FIFO: launches keep call order
            self._attach_loop()
            with anyio.CancelScope(shield=True):
                handle = await anyio.to_thread.run_sync(
                    self._queue, mapping, lane, claimed, limiter=lane.submitter
                )
        self._reap()
        return handle

    def _prepare(
        self, spec: TransferSpec | Sequence[TransferSpec], ready: Any
    ) -> tuple[Mapping, Lane]:
        """Check `spec` and order its lane's stream after `ready`, on the calling
        thread: the copy waits for what `ready` held at this call, even when it is
        issued later from the submitter thread (a copy issued before it in between
        only waits longer)."""
        specs = [spec] if isinstance(spec, TransferSpec) else list(spec)
        mapping = map_specs(specs, self.geometry)
        ready = ready if ready is not None else self._ready
        if self._streams.asynchronous and ready is None:
            raise TransferSpecError(
                "a CUDA transfer must be ordered after the engine's work: pass ready= "
                "(the stream the model writes KV on, or an event recorded after it) to "
                "TransferWorker(...) or to this call"
            )
        lane = self._lanes[mapping.direction]
        if self._streams.asynchronous:
            self._streams.order_after(lane.stream, ready)
        return mapping, lane

    def _queue(self, mapping: Mapping, lane: Lane, claimed: bool) -> TransferHandle:
        """Plan and issue the copy of `mapping` (on CPU: do it) and put it in flight.
        Runs on the caller's thread or the lane's submitter thread; touches nothing the
        event loop alone owns (waiters, `_finished`). The completion thread is not
        told: a waiter that must sleep hands the copy to it (`Lane.watch_all`)."""
        poll = self.geometry.pages(mapping.gpu) < self._poll_max_pages
        with lane.launching:
            launched = self._launch(mapping, lane)
            handle = TransferHandle(
                next(self._ids),
                mapping.direction,
                mapping.num_blocks,
                mapping.num_bytes,
                launched.backend,
                done_event=launched.completion.event,
                _completion=launched.completion,
                _keepalive=launched.keepalive,
                _claimed=claimed,
                _poll=poll,
            )
            lane.in_flight.append(handle)
        return handle

    # -- completion ---------------------------------------------------------------------
    def _notify(self) -> None:
        """Completion thread: a copy finished; have the loop look (thread-safe)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits on it
            loop.call_soon_threadsafe(self._on_progress)

    def _on_progress(self) -> None:
        self._reap()
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.set()

    def _reap(self) -> None:
        """Finish, in order, every transfer whose copy is complete, and wake the first
        waiter of each direction if its transfer is done."""
        for lane in self._lanes.values():
            lane.reap(self._keep_unclaimed)

    def get_finished(self) -> list[TransferResult]:
        """Results of completed transfers that no `wait` claimed, in submission order
        within each direction; each result is handed out once."""
        self._reap()
        finished = list(self._finished)
        self._finished.clear()
        return finished

    def _keep_unclaimed(self, result: TransferResult) -> None:
        if len(self._finished) == self._finished.maxlen:
            self.unclaimed_dropped += 1  # the deque drops the oldest
        self._finished.append(result)

    @property
    def num_in_flight(self) -> int:
        return sum(len(lane.in_flight) for lane in self._lanes.values())

    def _attach_loop(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def wait(self, handle: TransferHandle) -> TransferResult:
        """Wait for `handle`'s copy without blocking the event loop, and return its
        result. A transfer is finished only once every earlier one of its direction
        is (a later copy seen done first waits); waits in one direction return in the
        order they began. If the wait is cancelled, the result goes to `get_finished`
        instead."""
        if handle._claimed:
            raise RuntimeError(f"transfer {handle.transfer_id} is already being awaited")
        handle._claimed = True
        return await self._wait_claimed(handle)

    async def _wait_claimed(self, handle: TransferHandle) -> TransferResult:
        self._attach_loop()  # before looking: a copy finishing later wakes this loop
        for i, earlier in enumerate(self._finished):  # done before anyone waited
            if earlier is handle.result:
                del self._finished[i]
                break
        lane = self._lanes[handle.direction]
        lane.waiters.append(handle)
        delivered = False
        polling_until: float | None = None
        start_by = 0.0
        try:
            await anyio.lowlevel.checkpoint()
            while True:
                self._reap()
                first: TransferHandle = lane.waiters[0]
                if handle.done() and first is handle:
                    delivered = True
                    break
                if handle._poll and handle._completion is not None:
                    # a short copy: look again after the loop's other ready tasks,
                    # rather than sleep until the completion thread wakes the loop;
                    # but not at one still queued behind `ready` (a model step)
                    now = time.perf_counter()
                    if polling_until is None:
                        polling_until = now + self._poll_seconds
                        start_by = now + START_WAIT_SECONDS
                    if now < polling_until and (
                        now < start_by or handle._completion.started()
                    ):
                        await anyio.lowlevel.checkpoint()
                        continue
                lane.watch_all()  # the completion thread wakes this task
                handle._wakeup = anyio.Event()  # set by _reap or by the waiter before
                await handle._wakeup.wait()
        finally:
            lane.waiters.remove(handle)
            handle._wakeup = None
            if not delivered:
                handle._claimed = False
                if handle.result is not None:
                    self._keep_unclaimed(handle.result)
            if lane.waiters and lane.waiters[0]._wakeup:
                lane.waiters[0]._wakeup.set()
        assert handle.result is not None
        return handle.result

    async def transfer(
        self, spec: TransferSpec | Sequence[TransferSpec], *, ready: Any = None
    ) -> TransferResult:
        """Copy `spec` (or several specs of one direction, as one submission) and
        return once the bytes are in place.

        Once submitted, the copy is awaited to its end even if the caller is cancelled
        (the wait is shielded, and copies are bounded): the caller frees or reuses the
        slots and GPU blocks as soon as this returns or raises, so it must not return
        while a queued copy could still touch them."""
        with anyio.CancelScope(shield=True):
            handle = await self._start(spec, ready, claimed=True)
            result = await self._wait_claimed(handle)
        return result

    async def drain(self) -> None:
        """Wait until no transfer is in flight (results stay where they would go)."""
        self._attach_loop()
        while True:
            self._reap()
            if not self.num_in_flight:
                return
            for lane in self._lanes.values():
                lane.watch_all()
            if self._progress is None:
                self._progress = anyio.Event()
            await self._progress.wait()

    def close(self) -> None:
        """Stop the completion threads once the copies they watch are done. Blocks
        until then; call it after `drain`."""
        for lane in self._lanes.values():
            lane.completions.close()
