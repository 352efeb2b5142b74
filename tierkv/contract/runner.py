"""One per-key job runner for every tier: concurrency, a deadline, late keys, partial
results, and cancellation that waits for threads.

A tier's job moves many blocks; each block (or small batch of blocks) succeeds or
fails on its own. `run_job` runs a tier's `work(batch)` coroutine over the batches of
a job with at most `concurrency` in flight, and turns what happened into the one
`JobResult` the contract asks for:

- `work` returns the keys of its batch that failed, with a reason (or nothing: all ok);
- `work` raising `JobAborted` fails its batch and every batch not yet started (the
  server is down, the bucket is gone: waiting on it again per key helps no one);
- `work` raising anything else fails its batch with the error, logged once: a bug in
  one batch must not fail the whole server;
- keys not done by `timeout` are reported failed as late; the runner returns at the
  deadline, after the batches in flight were cancelled (and their threads finished).

Blocking calls and whole-block CPU work (framing, checksums, copies of MiB-sized
blocks) go through `in_thread`: anyio's worker threads, whose cancellation waits for
the thread to return, so after `run_job` returns or is cancelled no thread of it still
touches a primary slot.

Network I/O through a synchronous client is the exception: a thread waiting on a frozen
server cannot be interrupted, and waiting for it would keep the job past its deadline.
Such calls go through `IOThreads.run` (or `in_thread_abandoned_on_cancel`), whose
cancellation returns at once and leaves the thread to its socket timeouts; the thread
reads or writes slots only under the job's `SlotGuard`, which the job closes before it
returns, so the promise above holds for them too.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from tierkv.contract.jobs import JobMetadata, JobResult
from tierkv.contract.keys import OffloadKey

__all__ = [
    "Batch",
    "BlockThreads",
    "FreeSlots",
    "IOThreads",
    "JobAborted",
    "SlotGuard",
    "Work",
    "in_thread",
    "in_thread_abandoned_on_cancel",
    "run_job",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

Batch = Sequence[tuple[OffloadKey, int]]
"""(key, slot) pairs of one job that one `work` call moves."""

Work = Callable[[Batch], Awaitable[Mapping[OffloadKey, str] | None]]
"""Moves one batch; returns {key: reason} for the keys of the batch that failed."""


class JobAborted(Exception):
    """Raised by `work` when the rest of the job cannot succeed either (the medium is
    unreachable, the bucket is gone, access is denied). Its message is the reason."""


async def in_thread(
    func: Callable[..., T],
    *args: Any,
    limiter: anyio.CapacityLimiter | None = None,
    shield: bool = False,
) -> T:
    """Run blocking `func(*args)` in a worker thread and return its result.

    Cancelling the caller waits for the thread to return (its result is dropped), so a
    job never touches its slots after it ended. `shield=True` also keeps the caller
    from being cancelled until the call's result is back, for work whose bookkeeping
    after the call must happen (an index that must agree with the disk)."""
    if shield:
        with anyio.CancelScope(shield=True):
            return await anyio.to_thread.run_sync(func, *args, limiter=limiter)
    return await anyio.to_thread.run_sync(func, *args, limiter=limiter)


class SlotGuard:
    """Lets a thread that may outlive its job touch the job's slots only while the job
    lives.

    A thread doing network I/O (a socket waiting on a frozen server) cannot be
    interrupted, so a job that must end at its deadline leaves it behind
    (`in_thread_abandoned_on_cancel`). Such a thread reads or writes slots only inside
    `with guard.hold() as alive:` and only when `alive`; the job calls `close()` when
    it ends, which waits for a holder to finish its one block and makes every later
    `hold()` see False. After `close()` returns no thread of the job touches a slot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._alive = True

    @contextmanager
    def hold(self) -> Iterator[bool]:
        """Worker thread: True while the job lives; the job cannot end meanwhile."""
        with self._lock:
            yield self._alive

    def close(self) -> None:
        """The job ended: wait for the current holder (one block's copy or check, well
        under a millisecond), then refuse every later one."""
        with self._lock:
            self._alive = False


class IOThreads:
    """A tier's own worker threads for blocking network I/O (a synchronous client's
    request, with the framing or checking of its block), `size` at a time.

    Like `in_thread_abandoned_on_cancel`, cancelling a `run` returns at once and leaves
    the thread to finish on its own; the function must touch slots only under a
    `SlotGuard`. On asyncio the hop goes through a `ThreadPoolExecutor` of the tier's
    own: about 20 us of event-loop CPU per call against about 50 us through anyio's
    thread pool (measured), which matters when `size` calls finish in one loop turn.
    Any other backend gets anyio's threads. `close()` (the tier's close) lets the
    threads go once they are idle; a closed pool refuses new calls."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._executor = ThreadPoolExecutor(size, thread_name_prefix=name)
        self._limiter = anyio.CapacityLimiter(size)

    async def run(self, func: Callable[..., T], *args: Any) -> T:
        """`func(*args)` in one of the threads; its result, or its exception."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio
            return await in_thread_abandoned_on_cancel(func, *args, limiter=self._limiter)
        return await loop.run_in_executor(self._executor, func, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class FreeSlots:
    """`async with slots:` bounds how many callers are inside at once, as an
    `anyio.Semaphore` of `size` does, but a caller that finds a slot free goes in
    without yielding to the event loop (the semaphore's `async with` took 7 us of the
    loop's CPU on the 2-core dev VM with nothing else to run, more on a busy loop), which
    a tier pays per thread call; a cancelled caller still stops at the door. A caller
    that must wait waits as on the semaphore, in order."""

    def __init__(self, size: int) -> None:
        self._semaphore = anyio.Semaphore(size)

    @property
    def free(self) -> int:
        return self._semaphore.value

    async def __aenter__(self) -> None:
        await anyio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller stops here
        try:
            self._semaphore.acquire_nowait()
        except anyio.WouldBlock:
            await self._semaphore.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self._semaphore.release()


class BlockThreads:
    """A tier's own worker threads for block I/O and framing, `size` at a time, with
    `in_thread`'s promise: cancelling a `run` waits for its thread to return (and with
    `shield=True` the caller is not cancelled until the result is back), so no thread
    of a job touches a slot after the job ended.

    The hop costs the event loop less than anyio's thread pool: on asyncio a call is an
    executor submit and one `call_soon_threadsafe` back, with no capacity-limiter
    checkpoints or cancel scopes around it (anyio's hand-off took 60-100 us of the
    loop's CPU per call on the 2-core dev VM, this one 40-55 us, measured), which a
    tier answering hundreds of small-block jobs a second pays on every job. A call
    beyond `size` waits in the executor's queue. Any other backend gets anyio's
    threads under a limiter of `size`. `close()` lets the threads go once idle."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._executor = ThreadPoolExecutor(size, thread_name_prefix=name)
        self._limiter = anyio.CapacityLimiter(size)

    async def run(self, func: Callable[..., T], *args: Any, shield: bool = False) -> T:
        """`func(*args)` in one of the threads; its result, or its exception."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio
            return await in_thread(func, *args, limiter=self._limiter, shield=shield)
        done: asyncio.Future[T] = loop.create_future()
        call = self._executor.submit(func, *args)
        call.add_done_callback(functools.partial(_answer_from_thread, loop, done))
        try:
            if shield:
                with anyio.CancelScope(shield=True):
                    return await done
            return await done
        except BaseException:
            if not call.done():  # cancelled: the thread still runs; wait for it
                with anyio.CancelScope(shield=True):
                    await _thread_returned(loop, call)
            raise

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _answer_from_thread(
    loop: asyncio.AbstractEventLoop, done: asyncio.Future[T], call: Future[T]
) -> None:
    """Worker thread (the executor's done callback): hand `call`'s outcome to `done`
    on its loop, unless the loop is gone."""
    with suppress(RuntimeError):  # the loop was closed meanwhile: nobody waits any more
        loop.call_soon_threadsafe(_settle, done, call)


def _settle(done: asyncio.Future[T], call: Future[T]) -> None:
    if done.done():  # its waiter was cancelled
        return
    if call.cancelled():  # never ran: the pool was closed (`close`)
        done.set_exception(RuntimeError("the tier's block threads were closed"))
        return
    error = call.exception()
    if error is None:
        done.set_result(call.result())
    else:
        done.set_exception(error)


async def _thread_returned(loop: asyncio.AbstractEventLoop, call: Future[Any]) -> None:
    """Wait (on `loop`) until the executor's `call` has returned, whatever it did."""
    returned: asyncio.Future[None] = loop.create_future()

    def set_returned() -> None:
        if not returned.done():
            returned.set_result(None)

    def tell(_call: Future[Any]) -> None:
        with suppress(RuntimeError):
            loop.call_soon_threadsafe(set_returned)

    call.add_done_callback(tell)
    await returned


async def in_thread_abandoned_on_cancel(
    func: Callable[..., T], *args: Any, limiter: anyio.CapacityLimiter | None = None
) -> T:
    """Run blocking network I/O `func(*args)` in a worker thread; cancelling the caller
    returns at once and leaves the thread to finish on its own (bounded by its socket
    timeouts). `func` must touch slots only under a `SlotGuard` that the job closes."""
    return await anyio.to_thread.run_sync(func, *args, limiter=limiter, abandon_on_cancel=True)


def per_key(job: JobMetadata) -> list[Batch]:
    """One batch per (key, slot) of `job`."""
    return [[pair] for pair in zip(job.keys, job.slots)]


def in_batches(job: JobMetadata, size: int) -> list[Batch]:
    """The (key, slot) pairs of `job` in order, `size` at a time."""
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    pairs = list(zip(job.keys, job.slots))
    return [pairs[i : i + size] for i in range(0, len(pairs), size)]


async def run_job(
    job: JobMetadata,
    work: Work,
    *,
    label: str,
    concurrency: int,
    timeout: float | None,
    batches: Sequence[Batch] | None = None,
    on_late: Callable[[Sequence[OffloadKey]], None] | None = None,
) -> JobResult:
    """Run `work` over the batches of `job` (default: one per key), `concurrency` at
    a time, and report every key exactly once.

    `label` names the tier and verb in messages ("redis store"). Keys not finished by
    `timeout` seconds (None: no deadline) fail as late; `on_late(keys)` is called with
    them (a tier may forget what it is no longer sure of)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    plan = per_key(job) if batches is None else list(batches)
    run = _JobRun(job, work, label)
    queue = iter(plan)

    async def worker() -> None:
        for batch in queue:  # shared: each batch goes to exactly one worker
            await run.batch(batch)

    workers = min(concurrency, len(plan))
    with anyio.move_on_after(timeout):
        if workers == 1:
            await worker()
        elif workers > 1:
            async with anyio.create_task_group() as tg:
                for _ in range(workers):
                    tg.start_soon(worker)
    failed = run.failed
    # done and failed are disjoint subsets of the job's (distinct) keys: all answered
    # when their sizes add up, and no pass over the keys is needed
    answered = len(run.done) + len(failed) == len(job.keys)
    late = [] if answered else [k for k in job.keys if k not in run.done and k not in failed]
    if late:
        reason = f"{label} did not finish within job_timeout={timeout}s"
        failed.update((key, reason) for key in late)
        if on_late is not None:
            on_late(late)
    return JobResult.partial(job, failed)


class _JobRun:
    """What the batches of one `run_job` did: keys done, keys failed with a reason,
    and the reason the job was aborted (once a batch raised `JobAborted`, later
    batches are not tried)."""

    def __init__(self, job: JobMetadata, work: Work, label: str) -> None:
        self.job = job
        self.work = work
        self.label = label
        self.failed: dict[OffloadKey, str] = {}
        self.done: set[OffloadKey] = set()
        self.aborted: str | None = None

    async def batch(self, batch: Batch) -> None:
        keys = [key for key, _slot in batch]
        if self.aborted is not None:
            self.failed.update((key, f"not tried: {self.aborted}") for key in keys)
            return
        try:
            errors = await self.work(batch)
        except JobAborted as exc:
            reason = str(exc) or f"{self.label} aborted"
            if self.aborted is None:
                self.aborted = reason
                logger.warning("%s job %d aborted: %s", self.label, self.job.job_id, reason)
            self.failed.update((key, reason) for key in keys)
            return
        except Exception as exc:  # a bug must fail its keys, not the whole server
            logger.exception("%s job %d: unexpected error", self.label, self.job.job_id)
            self.failed.update((key, f"unexpected {type(exc).__name__}: {exc}") for key in keys)
            return
        if not errors:  # the common case, one C-level pass
            self.done.update(keys)
            return
        for key in keys:
            why = errors.get(key)
            if why is None:
                self.done.add(key)
            else:
                self.failed[key] = why
