"""`SyncChain`: a chain of guarded tiers an engine calls synchronously, from any of its
threads, and that answers within a deadline whatever the tiers do.

SGLang's HiCache (and LMCache's L2 adapters) call their storage layer synchronously
and never interrupt a call that blocks: a storage call that hangs hangs the engine's
prefetch or write-back thread. This class is the one place where such a call crosses
to the tiers' event loop (`LoopThread`) and comes back: each call runs as one
coroutine bounded by its deadline; when the deadline passes the coroutine cancels the
tier jobs still running (a tier job touches no slot after it was cancelled, by the
contract) and answers with what finished. The engine's thread waits for that answer
a little longer than the deadline (`margin`), then answers a miss regardless; a
coroutine still waiting then (for a tier's thread) is left to end with that thread,
never cut through the tier's shields. Nothing raises into the engine: a tier that
fails, refuses, is slow or down is a miss.

The tiers themselves are driven by `GuardedTier` (breaker, in-flight budget, answer
checks, deadline backstop, reopen); this class only fans a call out over the chain:

- `present`: every usable tier is asked at once; a key is present if any tier has it.
- `load`: tier by tier, in chain order, each asked only for the keys the tiers above
  did not deliver.
- `store`: every usable tier at once (write-through); a key is stored if any tier took
  it.

An engine that submits work and hears back later (LMCache's L2 adapters: submit a
task, get an event fd signalled) uses the `start_*` calls instead: the same coroutine
under the same deadline, whose answer goes to a callback on the loop thread, called
exactly once (when the work ends, or at deadline + `margin` whatever the tiers do).
`start_lookup` also claims the hits in the tier that will serve them
(`tierkv.driver.claims.ClaimLedger`, kept under an owner the caller names) until
`let_go` or the tier's lease. `start_store` and `start_load` may also report, per
tier, the keys each tier job moved (`on_tier`): a caller that keeps its own record
of where keys are held (LMCache's key listing) learns it there, on the loop thread,
in order with the tier's removal reports.

Per-tenant quotas (`quotas`: tier name -> `TierQuotas`, a chain file's
`tenants.quotas`) go to the tiers they name (`GuardedTier.set_quotas`): each store
of the chain then stays within the share of its call's tenant (`tenant=`) on the tiers
that can name their victims (`tierkv.quotas.tiers`); a key a quota keeps out of every
tier is not among the keys stored.

One event-loop thread serves every chain of a process (`shared_loop`): an engine that
builds several storage objects (one per pool, a re-attach) does not gather threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import anyio

from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.slab import PrimaryView
from tierkv.contract.tier import TierConfig
from tierkv.driver.checks import backstop_after
from tierkv.driver.claims import ClaimLedger, Taken
from tierkv.driver.guarded import GuardedTier, JobKind
from tierkv.driver.loop_thread import LoopThread
from tierkv.quotas.config import TierQuotas

TierMoved = Callable[[GuardedTier, tuple[OffloadKey, ...]], None]
"""Called on the loop thread with a tier and the keys one of its jobs just moved."""

__all__ = ["SyncChain", "release_shared_loop", "shared_loop"]

logger = logging.getLogger(__name__)

_loop_lock = threading.Lock()
_loop: LoopThread | None = None
_loop_users = 0


def shared_loop() -> LoopThread:
    """The process's tier loop thread, started by its first user; pair with
    `release_shared_loop`."""
    global _loop, _loop_users
    with _loop_lock:
        if _loop is None or not _loop.is_alive():
            _loop = LoopThread("tierkv-engine-loop")
            _loop_users = 0
        _loop_users += 1
        return _loop


def release_shared_loop(loop: LoopThread) -> None:
    """One user of `loop` is done; the last one stops it."""
    global _loop, _loop_users
    with _loop_lock:
        if loop is not _loop:
            loop.stop()  # a loop replaced after it died: nobody else uses it
            return
        _loop_users -= 1
        if _loop_users <= 0:
            _loop, _loop_users = None, 0
            loop.stop()


class SyncChain:
    """Tiers `configs` (chain order) over `view`, driven from an engine's threads."""

    def __init__(
        self,
        configs: Sequence[TierConfig],
        names: Sequence[str],
        view: PrimaryView,
        *,
        lookup_timeout: float | None = None,
        margin: float = 1.0,
        tags: dict[str, Any] | None = None,
        on_removed: Callable[[GuardedTier, tuple[OffloadKey, ...]], None] | None = None,
        quotas: Mapping[str, TierQuotas] | None = None,
    ) -> None:
        unknown = sorted(set(quotas or ()) - set(names))
        if unknown:  # `parse_config` refuses these in a chain file: a caller's slip
            raise ValueError(
                f"quotas for {', '.join(map(repr, unknown))}, which names no tier of the "
                f"chain ({', '.join(map(repr, names))})"
            )
        self.view = view
        view.engine_owned = True  # answered pages are the engine's again at once
        self.tiers = [
            GuardedTier.create(config, view, index=i, name=name, on_removed=on_removed)
            for i, (config, name) in enumerate(zip(configs, names))
        ]
        for tier in self.tiers:  # each tenant held to its share of the tiers named
            if quotas and tier.name in quotas:
                tier.set_quotas(quotas[tier.name])
        self.claims = ClaimLedger(self.tiers)
        """Claims `start_lookup` took, per owner; used on the loop thread only."""
        slowest = max((float(c.job_timeout) for c in configs), default=1.0)
        self.job_deadline = backstop_after(slowest)
        """How long a load or store may take in all: the slowest tier's job_timeout
        plus the driver's grace (its backstop)."""
        self.lookup_timeout = slowest if lookup_timeout is None else lookup_timeout
        self.margin = margin
        self._ctx = ReqContext(tags=tags or {})
        self._ids = itertools.count(1)
        self._closed = False
        self.late_answers = 0
        """Calls whose coroutine did not answer by deadline + margin (a tier broke the
        contract and ignored cancellation): answered as misses anyway."""
        self._loop = shared_loop()
        try:
            self._open()
        except BaseException:
            release_shared_loop(self._loop)
            raise

    # -- life -----------------------------------------------------------------------------
    def _open(self) -> None:
        """Open every tier: a required one that fails raises `TierUnavailable`; an
        optional one serves as a miss and reopens in the background."""
        for tier in self.tiers:
            try:
                self._loop.run(tier.open(), timeout=max(60.0, self.job_deadline))
            except BaseException:
                self._loop.run(self._close_all(), timeout=60.0)
                raise
            if not tier.opened:
                self._loop.spawn(tier.keep_opening)

    def close(self, timeout: float = 30.0) -> None:
        """Close every tier (bounded by `timeout`) and let go of the loop thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._close_all(timeout), timeout=timeout + 5.0)
        except Exception:
            logger.exception("tierkv: the tier chain did not close cleanly")
        finally:
            release_shared_loop(self._loop)

    async def _close_all(self, timeout: float = 30.0) -> None:
        self.claims.let_go_all()
        for tier in self.tiers:
            await tier.close(timeout=timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def capacity_blocks(self) -> int | None:
        """The most blocks the chain holds when full: every tier is written each
        block, so the largest tier bounds it (not the sum). None when some tier
        names no bound of its own (`room`: a Redis, a bucket)."""
        tiers = [t.tier for t in self.tiers]
        if not tiers or not all(t.names_eviction_candidates and t.reports_evictions for t in tiers):
            return None

        async def largest() -> int:
            return max(t.room().capacity_blocks for t in tiers)

        return self._loop.run(largest(), timeout=10.0)

    # -- calls from the engine's threads --------------------------------------------------
    def present(
        self,
        keys: Sequence[OffloadKey],
        budget: float | None = None,
        owner: str | None = None,
        tenant: str | None = None,
    ) -> list[bool]:
        """One flag per key: some tier holds it. Misses for whatever is not known by
        `lookup_timeout` (or `budget` seconds, when the caller has less time left).
        With an `owner`, each hit is claimed in the first tier that reported it, as by
        `start_lookup`, until `let_go(owner, ...)` or the tier's lease runs out. Every
        call of the chain takes the `tenant` of its request (`ReqContext.tenant`)."""
        found = [False] * len(keys)
        if keys:
            work = self._present(keys, found, owner, self._ctx_for(tenant))
            self._call(work, self._limit(self.lookup_timeout, budget))
        return found

    def load(
        self,
        keys: Sequence[OffloadKey],
        slots: Sequence[int],
        budget: float | None = None,
        tenant: str | None = None,
    ) -> set[OffloadKey]:
        """Read `keys[i]` into primary slot `slots[i]`; the keys that arrived whole
        (by the deadline, or `budget`). The slot of a key not returned holds undefined
        bytes."""
        done: set[OffloadKey] = set()
        if keys:
            work = self._jobs("load", keys, slots, done, ctx=self._ctx_for(tenant))
            self._call(work, self._limit(self.job_deadline, budget))
        return set(done)

    def store(
        self,
        keys: Sequence[OffloadKey],
        slots: Sequence[int],
        budget: float | None = None,
        tenant: str | None = None,
    ) -> set[OffloadKey]:
        """Write `keys[i]` from slot `slots[i]` to every usable tier; the keys some tier
        took (by the deadline, or `budget`)."""
        done: set[OffloadKey] = set()
        if keys:
            work = self._jobs("store", keys, slots, done, ctx=self._ctx_for(tenant))
            self._call(work, self._limit(self.job_deadline, budget))
        return set(done)

    @staticmethod
    def _limit(deadline: float, budget: float | None) -> float:
        """The caller's time left, where it is less than the call's own deadline (a
        caller making several calls for one engine call keeps to one deadline); a
        call past its budget is cut at once (its tier jobs cancelled, by contract
        harmless)."""
        return deadline if budget is None else max(0.0, min(deadline, budget))

    def remove_all(self, keys: Sequence[OffloadKey]) -> None:
        """Ask every tier to drop `keys` (a hint: failures are logged)."""

        async def remove() -> None:
            for tier in self.tiers:
                if tier.opened:  # a hint, not a call the breakers judge
                    try:
                        await tier.tier.remove(keys)
                    except Exception as exc:
                        logger.warning("tierkv tier %s: remove failed: %s", tier.name, exc)

        self._call(remove(), self.job_deadline)

    # -- submitted from the engine's threads, answered on the loop ------------------------
    def start_lookup(
        self,
        keys: Sequence[OffloadKey],
        owner: str,
        on_done: Callable[[list[bool]], None],
        tenant: str | None = None,
    ) -> None:
        """`present`, without waiting: `on_done(flags)` on the loop thread once. Each hit
        is claimed in the first tier (chain order) that reported it, kept under `owner`
        until `let_go(owner, ...)` or the tier's lease runs out."""
        found = [False] * len(keys)
        work = self._present(keys, found, owner, self._ctx_for(tenant)) if keys else _nothing()
        self._begin(work, self.lookup_timeout, lambda: on_done(list(found)))

    def start_load(
        self,
        keys: Sequence[OffloadKey],
        slots: Sequence[int],
        on_done: Callable[[set[OffloadKey]], None],
        on_tier: TierMoved | None = None,
        tenant: str | None = None,
    ) -> None:
        """`load`, without waiting: `on_done(keys that arrived whole)` on the loop thread
        once. The slots must stay valid until then, and are not touched after. With
        `on_tier`, `on_tier(tier, keys)` as each tier job delivers keys."""
        done: set[OffloadKey] = set()
        ctx = self._ctx_for(tenant)
        work = self._jobs("load", keys, slots, done, on_tier, ctx) if keys else _nothing()
        self._begin(work, self.job_deadline, lambda: on_done(set(done)))

    def start_store(
        self,
        keys: Sequence[OffloadKey],
        slots: Sequence[int],
        on_done: Callable[[set[OffloadKey]], None],
        on_tier: TierMoved | None = None,
        tenant: str | None = None,
    ) -> None:
        """`store`, without waiting: `on_done(keys some tier took)` on the loop thread
        once. With `on_tier`, `on_tier(tier, keys)` as each tier job stores keys (a key
        the tier reported removed while its job ran is not among them)."""
        done: set[OffloadKey] = set()
        ctx = self._ctx_for(tenant)
        work = self._jobs("store", keys, slots, done, on_tier, ctx) if keys else _nothing()
        self._begin(work, self.job_deadline, lambda: on_done(set(done)))

    def let_go(self, owner: str, keys: Sequence[OffloadKey] | None = None) -> None:
        """End `owner`'s claims on `keys` (all when None), on the loop, soon; never
        raises. Where the loop is gone the claims end with their lease."""
        if self._closed or not self._loop.is_alive():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: the lease ends them
            self._loop.loop.call_soon_threadsafe(self.claims.let_go, owner, keys)

    def _begin(
        self, work: Coroutine[Any, Any, None], deadline: float, on_done: Callable[[], None]
    ) -> None:
        """Run `work` on the loop under `deadline` and call `on_done` exactly once, on
        the loop thread: when `work` ends, or at `deadline + margin` if a tier ignores
        cancellation (counted in `late_answers`). At once, on this thread, when the
        chain is closed. `on_done` raising is logged, never passed on."""
        called = False

        def finish() -> None:
            nonlocal called
            if called:
                return
            called = True
            try:
                on_done()
            except Exception:
                logger.exception("tierkv: a completion callback failed")

        if self._closed or not self._loop.is_alive():
            work.close()
            finish()
            return
        loop = self._loop.loop

        async def bounded() -> None:
            timer = loop.call_later(deadline + self.margin, late)
            try:
                with anyio.move_on_after(max(deadline, 0.0)):
                    await work
            except Exception:
                logger.exception("tierkv: a tier call failed; answering what finished")
            finally:
                timer.cancel()
                finish()

        def late() -> None:
            if not called:
                self.late_answers += 1
                logger.error(
                    "tierkv: a tier call gave no answer %gs after its %gs deadline, even "
                    "when cancelled; answering what finished (a tier ignores cancellation)",
                    self.margin,
                    deadline,
                )
                finish()

        try:
            asyncio.run_coroutine_threadsafe(bounded(), loop)
        except RuntimeError:  # the loop closed between the check and now
            work.close()
            finish()

    def _call(self, work: Coroutine[Any, Any, None], deadline: float) -> None:
        """Run `work` on the loop under `deadline` (it records its answers as they
        come, so what finished by then counts); give up waiting at `deadline +
        margin`. Never raises."""
        if self._closed or not self._loop.is_alive() or deadline <= 0:
            work.close()
            return

        async def bounded() -> None:
            with anyio.move_on_after(deadline):
                await work

        future = asyncio.run_coroutine_threadsafe(bounded(), self._loop.loop)
        try:
            future.result(timeout=deadline + self.margin)
        except FutureTimeout:
            # Cancelled at the deadline already; what still runs waits for a thread a
            # tier shielded (an nvme chunk whose index must agree with the disk). The
            # future's own cancel would cut through that shield and end the coroutine
            # with the thread still running and none of its bookkeeping done: it is
            # left to end when the thread does, as `_begin` leaves it.
            self.late_answers += 1
            logger.error(
                "tierkv: a tier call gave no answer %gs after its %gs deadline, even "
                "when cancelled; answering what finished (a tier ignores cancellation)",
                self.margin,
                deadline,
            )
        except Exception:
            logger.exception("tierkv: a tier call failed; answering what finished")

    # -- on the loop ---------------------------------------------------------------------
    def _ctx_for(self, tenant: str | None) -> ReqContext:
        """The context of a call for `tenant` (the chain's tags, no request id)."""
        if tenant is None:
            return self._ctx
        return ReqContext(tags=self._ctx.tags, tenant=tenant)

    async def _present(
        self,
        keys: Sequence[OffloadKey],
        found: list[bool],
        owner: str | None = None,
        ctx: ReqContext | None = None,
    ) -> None:
        """Fill `found`; with an `owner`, claim each hit in the first tier holding it
        (claims are taken the moment a tier answers, the ones not needed let go once
        every tier answered or the deadline cancelled the rest)."""
        taken: list[Taken] = []
        holder: dict[OffloadKey, int] = {}

        def claim(tier: GuardedTier, flags: list[bool]) -> None:  # as the tier answers
            hits = [k for k, flag in zip(keys, flags) if flag]
            if hits:
                taking = self.claims.take(tier, hits)
                if taking is not None:
                    taken.append(taking)

        async def ask(tier: GuardedTier) -> None:
            on_answer = None if owner is None else functools.partial(claim, tier)
            flags = await tier.lookup(keys, ctx or self._ctx, self.lookup_timeout, on_answer)
            if flags is None:
                return
            hits = [k for k, flag in zip(keys, flags) if flag]
            for i, flag in enumerate(flags):
                found[i] = found[i] or flag
            for key in hits:
                if holder.get(key, tier.index) >= tier.index:
                    holder[key] = tier.index

        try:
            async with anyio.create_task_group() as group:
                for tier in self.tiers:
                    if tier.usable("load"):  # asks; `lookup` takes the permit
                        group.start_soon(ask, tier)
        finally:
            if owner is not None:
                self.claims.keep(owner, taken, holder)

    async def _jobs(
        self,
        kind: JobKind,
        keys: Sequence[OffloadKey],
        slots: Sequence[int],
        done: set[OffloadKey],
        on_tier: TierMoved | None = None,
        ctx: ReqContext | None = None,
    ) -> None:
        ctx = ctx or self._ctx
        if kind == "store":
            async with anyio.create_task_group() as group:
                for tier in self.tiers:
                    group.start_soon(self._one_job, tier, kind, keys, slots, done, on_tier, ctx)
            return
        for tier in self.tiers:
            if done:  # what the tiers above did not read
                wanted = [(k, s) for k, s in zip(keys, slots) if k not in done]
                if not wanted:
                    break
                keys, slots = [k for k, _ in wanted], [s for _, s in wanted]
            await self._one_job(tier, kind, keys, slots, done, on_tier, ctx)

    async def _one_job(
        self,
        tier: GuardedTier,
        kind: JobKind,
        keys: Sequence[OffloadKey],
        slots: Sequence[int],
        done: set[OffloadKey],
        on_tier: TierMoved | None = None,
        ctx: ReqContext | None = None,
    ) -> None:
        """One job on one tier, admitted by its driver; adds the keys it moved (and
        tells `on_tier`, before anything else runs on the loop)."""
        nbytes = len(keys) * self.view.block_bytes
        if tier.admit(kind, len(keys), nbytes) is not None:
            return  # down, breaker open or too much in flight: counted by the driver
        try:
            job = JobMetadata(next(self._ids), tuple(keys), tuple(slots), ctx or self._ctx)
            outcome = await tier.run(kind, job, admitted=True)
        finally:
            tier.release(kind, nbytes)
        done.update(outcome.result.ok_keys)
        if on_tier is not None and outcome.result.ok_keys:
            try:
                on_tier(tier, tuple(outcome.result.ok_keys))
            except Exception:
                logger.exception("tierkv: a tier report callback failed")


async def _nothing() -> None:
    """The work of a call asked about no keys."""
