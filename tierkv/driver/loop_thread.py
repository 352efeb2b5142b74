"""One asyncio event loop on its own thread, owned by one engine adapter.

Engines call their tiers synchronously from their own threads (vLLM's scheduler,
SGLang's cache controller, LMCache's controller threads); tierkv tiers are async. An
adapter hands every tier coroutine to this loop with `spawn` (a thread-safe call that
only enqueues) and reads the outcomes from thread-safe queues (`engine_jobs`); only
start-up (`run`, opening the tier) and shutdown wait on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


class LoopThread:
    """A daemon thread running an event loop until `stop`."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._stopped: asyncio.Future[None] = self._loop.create_future()
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        """Run the loop until `stop`, as `run_until_complete` of one long-lived task
        rather than `run_forever`: anyio keeps its worker threads (`to_thread`) alive
        as long as the "root task" it finds, and under `run_forever` it takes the task
        of each call for it, so every engine call started its worker threads afresh
        and stopped them when it ended (a third of the loop thread's samples on 64 KiB
        SGLang pages, measured). A task run by `run_until_complete` is what anyio looks
        for: its threads now live until they idle out."""
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except RuntimeError as exc:  # `loop.stop()` called from outside, not `stop()`
            logger.warning(
                "%s: its event loop was stopped from outside (%s)", self._thread.name, exc
            )
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def on_loop(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self._thread

    def spawn(self, factory: Callable[[], Awaitable[Any]]) -> None:
        """Run `factory()` as a task on the loop. Never blocks, never raises for the
        task's sake: the coroutine must report its own outcome."""

        def start() -> None:
            task = self._loop.create_task(_awaited(factory))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._loop.call_soon_threadsafe(start)

    async def cancel_spawned(self) -> None:
        """Cancel every task `spawn` started and wait until each has ended (a tier
        call shielded from cancellation, such as a thread doing block I/O, is waited
        for, so nothing touches the primary slab after this returns). Loop thread."""
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for it (start-up and shutdown only)."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def is_alive(self) -> bool:
        """Whether the loop's thread still runs (it may die with the process's
        other threads, or be stopped): jobs on it can still end only while it does."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (after its current callbacks) and join the thread."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._set_stopped)
        self._thread.join(timeout)

    async def _serve(self) -> None:
        """The loop's root task (see `_main`): waits for `stop`."""
        await self._stopped

    def _set_stopped(self) -> None:
        if not self._stopped.done():
            self._stopped.set_result(None)


async def _awaited(factory: Callable[[], Awaitable[Any]]) -> None:
    await factory()
