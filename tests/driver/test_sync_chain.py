"""`SyncChain`: a chain of guarded tiers called from plain threads, answering within
its deadline whatever the tiers do, on one shared event-loop thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tierkv.contract.keys import make_offload_key
from tierkv.contract.slab import PrimaryView
from tierkv.driver.guarded import GuardedTier
from tierkv.driver.sync_chain import SyncChain
from tierkv.memory_tier import MemoryTierConfig
from tierkv.registry import register_tier, unregister_tier
from tierkv.testing import FaultyTier
from tierkv.testing.faulty import FaultyTierConfig

BLOCK = 256


@pytest.fixture
def faulty() -> Iterator[None]:
    register_tier(FaultyTier)
    yield
    unregister_tier("faulty")


def keys(n: int, salt: str = "") -> list[bytes]:
    return [make_offload_key(f"{salt}{i:04d}".encode(), 0) for i in range(n)]


def view(slots: int = 16) -> PrimaryView:
    return PrimaryView(bytearray(BLOCK * slots), BLOCK, "test")


def loops() -> int:
    return sum(t.name == "tierkv-engine-loop" for t in threading.enumerate())


def test_store_present_load_round_trip() -> None:
    slab = view()
    chain = SyncChain([MemoryTierConfig(type="memory")], ["memory"], slab)
    try:
        for slot in range(4):
            slab.block(slot)[:] = bytes([slot + 1]) * BLOCK
        ks = keys(4)
        assert chain.store(ks, [0, 1, 2, 3]) == set(ks)
        assert chain.present([*ks, *keys(1, "x")]) == [True] * 4 + [False]
        assert chain.load(ks, [8, 9, 10, 11]) == set(ks)
        for i in range(4):
            assert bytes(slab.block(8 + i)) == bytes([i + 1]) * BLOCK
    finally:
        chain.close()


def test_load_asks_the_next_tier_for_what_the_first_lacks(faulty: None) -> None:
    slab = view()
    configs = [FaultyTierConfig(type="faulty", name="a"), MemoryTierConfig(type="memory")]
    chain = SyncChain(configs, ["a", "b"], slab)
    try:
        ks = keys(2)
        slab.block(0)[:] = b"\x07" * BLOCK
        slab.block(1)[:] = b"\x09" * BLOCK
        assert chain.store(ks, [0, 1]) == set(ks)
        first = chain.tiers[0].tier
        assert isinstance(first, FaultyTier)
        first.lie_about = {ks[1]}  # a cannot read it back: b must
        assert chain.load(ks, [4, 5]) == set(ks)
        assert bytes(slab.block(4)) == b"\x07" * BLOCK
        assert bytes(slab.block(5)) == b"\x09" * BLOCK
        loads = [op for op, _ in first.calls if op == "load"]
        assert len(loads) == 1  # b was asked only for the key a failed
        first.lie_about = set()
        chain.remove_all(ks)
        assert chain.present(ks) == [False, False]
    finally:
        chain.close()


def test_a_hung_tier_answers_misses_by_the_deadline(faulty: None) -> None:
    slab = view()
    config = FaultyTierConfig(type="faulty", job_timeout=0.3, failure_threshold=5)
    chain = SyncChain([config], ["faulty"], slab, lookup_timeout=0.2, margin=0.5)
    try:
        tier = chain.tiers[0].tier
        assert isinstance(tier, FaultyTier)
        tier.hang = True
        started = time.monotonic()
        assert chain.store(keys(3), [0, 1, 2]) == set()
        assert time.monotonic() - started < chain.job_deadline + chain.margin
        assert chain.load(keys(3), [0, 1, 2]) == set()
        started = time.monotonic()
        assert chain.load(keys(3), [0, 1, 2], budget=0.05) == set()  # the caller's time left
        assert time.monotonic() - started < 0.5
        assert chain.load(keys(3), [0, 1, 2], budget=0) == set()
        tier.hang = False
        assert chain.store(keys(3), [0, 1, 2]) == set(keys(3))
    finally:
        chain.close()


def test_a_call_left_at_its_margin_ends_when_its_thread_does(faulty: None) -> None:
    """A tier job waiting for a worker thread whose cancellation waits (a blocking call
    past the deadline): the engine's call answers by deadline + margin, and the job
    is left to end with its thread, its bookkeeping done then, not cut short while the
    thread runs on (a native cancel goes through anyio's shields)."""
    slab = view()
    config = FaultyTierConfig(type="faulty", job_timeout=0.2, failure_threshold=5)
    chain = SyncChain([config], ["faulty"], slab, lookup_timeout=0.2, margin=0.2)
    try:
        guarded = chain.tiers[0]
        tier = guarded.tier
        assert isinstance(tier, FaultyTier)
        tier.stuck = threading.Event()
        started = time.monotonic()
        assert chain.load(keys(2), [0, 1]) == set()
        assert time.monotonic() - started < chain.job_deadline + chain.margin + 0.2
        assert chain.late_answers == 1
        time.sleep(0.2)
        assert guarded.stats.inflight_jobs == 1  # still waiting for its thread
        tier.stuck.set()
        deadline = time.monotonic() + 5
        while guarded.stats.inflight_jobs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert guarded.stats.inflight_jobs == 0  # ended with it, counted
        tier.stuck = None
        slab.block(0)[:] = b"\x03" * BLOCK
        assert chain.store(keys(1), [0]) == set(keys(1))
    finally:
        chain.close()


def test_one_loop_thread_for_every_chain_of_the_process() -> None:
    before = loops()
    first = SyncChain([MemoryTierConfig(type="memory")], ["memory"], view())
    second = SyncChain([MemoryTierConfig(type="memory")], ["memory"], view())
    assert loops() == max(before, 1)
    first.close()
    assert second.present(keys(1)) == [False]
    second.close()
    assert loops() == 0
    assert second.present(keys(1)) == [False]  # closed: a miss, no exception


class Answers:
    """Collects `start_*` callbacks; `get` waits for the next one."""

    def __init__(self) -> None:
        self.got: list[object] = []
        self.threads: set[str] = set()
        self._event = threading.Event()

    def __call__(self, answer: object) -> None:
        self.got.append(answer)
        self.threads.add(threading.current_thread().name)
        self._event.set()

    def get(self, timeout: float = 10.0) -> object:
        assert self._event.wait(timeout), "no answer"
        self._event.clear()
        return self.got[-1]


def test_start_calls_answer_once_on_the_loop_and_claims_until_let_go() -> None:
    slab = view()
    config = MemoryTierConfig(type="memory", capacity=3 * (BLOCK + 128), claim_lease=30)
    chain = SyncChain([config], ["memory"], slab)
    try:
        answers = Answers()
        ks = keys(6)
        chain.start_store(ks[:3], [0, 1, 2], answers)
        assert answers.get() == set(ks[:3])
        chain.start_lookup(ks[:1], "owner-1", answers)
        assert answers.get() == [True]  # and claimed
        assert answers.threads == {"tierkv-engine-loop"}
        for i in range(3, 6):
            chain.store(ks[i : i + 1], [i])
        assert chain.present(ks[:3]) == [True, False, False]  # the claimed one stayed
        chain.let_go("owner-1")
        chain.store(keys(3, "y"), [6, 7, 8])
        assert chain.present(ks[:1]) == [False]
        chain.start_load([], [], answers)
        assert answers.get() == set()
        assert len(answers.got) == 3  # one answer per call
    finally:
        chain.close()
    answers = Answers()
    chain.start_load(ks[:1], [0], answers)  # closed: answered at once, on this thread
    assert answers.get(0) == set()


def test_start_answers_by_the_deadline_when_a_tier_hangs(faulty: None) -> None:
    slab = view()
    config = FaultyTierConfig(type="faulty", job_timeout=0.3)
    chain = SyncChain([config], ["faulty"], slab, margin=0.5)
    try:
        tier = chain.tiers[0].tier
        assert isinstance(tier, FaultyTier)
        tier.hang = True
        answers = Answers()
        started = time.monotonic()
        chain.start_load(keys(2), [0, 1], answers)
        assert answers.get() == set()
        assert time.monotonic() - started < chain.job_deadline + chain.margin
        time.sleep(0.2)
        assert len(answers.got) == 1
    finally:
        tier.hang = False
        chain.close()


def test_start_calls_report_each_tiers_keys_and_the_capacity_is_the_largest_tier() -> None:
    slab = view()
    small = MemoryTierConfig(type="memory", name="small", capacity=3 * (BLOCK + 128))
    large = MemoryTierConfig(type="memory", name="large", capacity=8 * (BLOCK + 128))
    chain = SyncChain([small, large], ["small", "large"], slab)
    try:
        fits = [t.tier.room().capacity_blocks for t in chain.tiers]
        assert fits[0] < 6 <= fits[1]
        assert chain.capacity_blocks() == fits[1]  # every tier holds a copy: not the sum
        held: list[tuple[str, set[bytes], str]] = []

        def on_tier(tier: GuardedTier, moved: tuple[bytes, ...]) -> None:
            held.append((tier.name, set(moved), threading.current_thread().name))

        answers = Answers()
        ks = keys(6)
        chain.start_store(ks, list(range(6)), answers, on_tier)
        assert answers.get() == set(ks)
        stored = {name: moved for name, moved, _ in held}
        assert stored["large"] == set(ks)
        assert len(stored["small"]) == fits[0]  # what it evicted during the job is left out
        assert {thread for _, _, thread in held} == {"tierkv-engine-loop"}
        held.clear()
        chain.start_load(ks, list(range(8, 14)), answers, on_tier)
        assert answers.get() == set(ks)
        loaded = {name: moved for name, moved, _ in held}
        assert loaded == {"small": stored["small"], "large": set(ks) - stored["small"]}
    finally:
        chain.close()
