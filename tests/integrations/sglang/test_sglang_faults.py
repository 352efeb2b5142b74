"""A tier that fails in the middle of SGLang's calls: every call still answers within
its deadline (a miss, never an exception), the backend serves again once the tier is
back, and no byte a call reported read is wrong; no late write lands in a host page
after its call answered."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

JOB_TIMEOUT = 1.0
FAST = {"job_timeout": f"{JOB_TIMEOUT}s", "recovery_after": "0.2s", "failure_threshold": 1}


def deadline(backend: Any) -> float:
    """The longest any call may take: the chain's deadline, its margin, and slack for
    a loaded test machine."""
    chain = backend.kv.components[0].chain
    return max(chain.job_deadline, chain.lookup_timeout) + chain.margin + 0.5


def timed(call: Any, *args: Any) -> tuple[Any, float]:
    started = time.monotonic()
    answer = call(*args)
    return answer, time.monotonic() - started


def until(check: Any, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def unwritable(root: Path) -> Iterator[None]:
    """The tier's directories immutable: a real EPERM (the compiled data path makes
    its system calls where no Python patch reaches); skipped where chattr is not
    permitted."""
    from tierkv.testing import DiskFaultUnavailable, immutable

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(immutable(root))
        except DiskFaultUnavailable as exc:
            pytest.skip(str(exc))
        yield


def test_nvme_unwritable_answers_false_then_serves_again(rig: Any) -> None:
    pool = rig.pool(pages=16)
    # an immutable directory fails writes of new files; a slab's slots are written in
    # files that exist already, which it does not stop
    backend = rig.backend(pool, [rig.nvme(**FAST, layout="files")])
    rig.fill(pool, list(range(8)), "nvme")
    hashes = rig.page_hashes(8, "ro")
    with unwritable(rig.tmp_path / "nvme"):
        answer, took = timed(backend.batch_set_v1, hashes[:4], pool.indices([0, 1, 2, 3]))
        assert answer == [False] * 4 and took < deadline(backend)
        assert backend.batch_exists(hashes[:4]) == 0
        # the breaker is open now: a miss at once, no exception
        answer, took = timed(backend.batch_get_v1, hashes[:4], pool.indices([8, 9, 10, 11]))
        assert answer == [False] * 4 and took < deadline(backend)
    assert until(lambda: backend.batch_set_v1(hashes, pool.indices(list(range(8)))) == [True] * 8)
    assert backend.batch_exists(hashes) == 8
    assert backend.batch_get_v1(hashes, pool.indices(list(range(8, 16)))) == [True] * 8
    assert [pool.page_bytes(8 + i) for i in range(8)] == [pool.page_bytes(i) for i in range(8)]


class Reader:
    """SGLang's I/O thread: reads the same pages over and over into spare host pages,
    timing each call and checking every page it reports read; after a miss it paints
    the target pages, and later checks nothing overwrote the paint."""

    def __init__(self, rig: Any, backend: Any, pool: Any, hashes: list[str]) -> None:
        self.rig, self.backend, self.pool, self.hashes = rig, backend, pool, hashes
        self.n = len(hashes)
        self.expected = [pool.page_bytes(i) for i in range(self.n)]
        self.slowest = 0.0
        self.hits = self.misses = self.wrong = 0
        self.painted: dict[int, bytes] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        targets = list(range(self.n, 2 * self.n))
        while not self.stop.is_set():
            indices = self.pool.indices(targets)
            answer, took = timed(self.backend.batch_get_v1, self.hashes, indices)
            self.slowest = max(self.slowest, took)
            for i, ok in enumerate(answer):
                if ok:
                    self.hits += 1
                    self.wrong += self.pool.page_bytes(targets[i]) != self.expected[i]
                else:
                    self.misses += 1
            if not all(answer):
                self.rig.fill(self.pool, targets, f"paint{self.misses}")
                self.painted = {t: self.pool.page_bytes(t) for t in targets}
                time.sleep(0.3)  # a late write would land now
                self.wrong += sum(self.pool.page_bytes(t) != b for t, b in self.painted.items())

    def __enter__(self) -> Reader:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(30)


def test_redis_frozen_mid_calls_misses_within_deadline(rig: Any, redis_server: Any) -> None:
    pool = rig.pool(pages=16)
    backend = rig.backend(pool, [{"type": "redis", "url": redis_server.url, **FAST}])
    rig.fill(pool, list(range(8)), "redis")
    hashes = rig.page_hashes(8, "frozen")
    assert backend.batch_set_v1(hashes, pool.indices(list(range(8)))) == [True] * 8
    with Reader(rig, backend, pool, hashes) as reader:
        assert until(lambda: reader.hits >= 8)
        redis_server.freeze()
        try:
            answer, took = timed(backend.batch_exists, hashes)
            assert answer == 0 and took < deadline(backend)
            other = rig.page_hashes(2, "x")
            written, took = timed(backend.batch_set_v1, other, pool.indices([0, 1]))
            assert written == [False, False] and took < deadline(backend)
            assert until(lambda: reader.misses >= 8)
        finally:
            redis_server.thaw()
        hits = reader.hits
        assert until(lambda: reader.hits >= hits + 16)
    assert reader.wrong == 0
    assert reader.slowest < deadline(backend)
    assert backend.batch_exists(hashes) == 8


def test_redis_stopped_then_restarted(rig: Any, redis_server: Any) -> None:
    pool = rig.pool(pages=16)
    backend = rig.backend(pool, [{"type": "redis", "url": redis_server.url, **FAST}])
    rig.fill(pool, list(range(8)), "restart")
    hashes = rig.page_hashes(8, "stopped")
    with Reader(rig, backend, pool, hashes) as reader:
        redis_server.stop()  # its pages are gone with it (persistence off)
        assert until(lambda: reader.misses >= 8)
        answer, took = timed(backend.batch_set_v1, hashes, pool.indices(list(range(8))))
        assert answer == [False] * 8 and took < deadline(backend)
        redis_server.start()
        assert until(
            lambda: backend.batch_set_v1(hashes, pool.indices(list(range(8)))) == [True] * 8
        )
        assert until(lambda: reader.hits >= 16)
    assert reader.wrong == 0
    assert reader.slowest < deadline(backend)


def test_a_pool_of_several_buffers_keeps_one_deadline(
    rig: Any, faulty_tier_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Mamba pool's page is three regions in three buffers; stored region by region
    (a chain with a tier that does not accept regions) each buffer has its own tiers:
    when all of them hang, a v2 call still answers within one deadline, not three."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from tierkv.integrations.sglang.stand_in import MambaPoolStandIn
    from tierkv.integrations.sglang.storage import TierkvHiCacheStorage

    monkeypatch.setattr(TierkvHiCacheStorage, "_whole_pages", lambda self: False)

    tier = {"type": faulty_tier_type, "job_timeout": "0.5s", "failure_threshold": 10}
    backend = rig.backend(rig.pool(pages=4), [tier])
    mamba = MambaPoolStandIn(slots=8)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    components = backend.sidecars["mamba"].components
    assert len(components) == 3
    hashes = rig.page_hashes(2, "hung")
    transfer = PoolTransfer(name=PoolName.MAMBA, host_indices=mamba.indices([0, 1]), keys=hashes)
    assert backend.batch_set_v2([transfer]) == {"mamba": [True, True]}
    for component in components:
        component.chain.tiers[0].tier.hang = True
    chain = components[0].chain
    answer, took = timed(backend.batch_get_v2, [transfer])
    assert answer == {"mamba": [False, False]}
    assert took < chain.job_deadline + chain.margin
    for component in components:
        component.chain.tiers[0].tier.hang = False
    assert until(lambda: backend.batch_get_v2([transfer]) == {"mamba": [True, True]})
