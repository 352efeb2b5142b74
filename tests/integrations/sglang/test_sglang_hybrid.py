"""Hybrid models through SGLang's v2 calls: a Mamba state pool (regions of several
sizes in several buffers) and a sliding-window KV pool beside the KV pool; pages round
trip byte for byte, and `batch_exists_v2` matches a brute-force oracle of SGLang's hit
rules on random presence patterns."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tierkv.integrations.sglang.stand_in import MambaPoolStandIn

N = 8


def names() -> Any:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return PoolName, PoolTransfer, PoolHitPolicy


@pytest.fixture
def hybrid(rig: Any) -> Any:
    PoolName, _, _ = names()
    kv = rig.pool(pages=2 * N)
    backend = rig.backend(kv, [rig.nvme()])
    mamba = MambaPoolStandIn(slots=2 * N)
    swa = rig.pool(pages=2 * N, head_dim=32)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    return backend, kv, mamba, swa


def test_v2_pools_round_trip(rig: Any, hybrid: Any) -> None:
    PoolName, PoolTransfer, _ = names()
    backend, _kv, mamba, swa = hybrid
    hashes = rig.page_hashes(4, "v2")
    mamba.fill([0, 1, 2, 3], "mamba")
    rig.fill(swa, [0, 1, 2, 3], "swa")
    put = [
        PoolTransfer(name=PoolName.MAMBA, host_indices=mamba.indices([0, 1, 2, 3]), keys=hashes),
        PoolTransfer(name=PoolName.SWA, host_indices=swa.indices([0, 1, 2, 3]), keys=hashes),
    ]
    assert backend.batch_set_v2(put) == {"mamba": [True] * 4, "swa": [True] * 4}
    # the sliding-window pool lays K and V out as the KV pool does: a page is one block;
    # the Mamba pool's regions are of three sizes in three buffers: one block too
    assert backend.sidecars["swa"].key_parts == 1
    assert backend.sidecars["mamba"].key_parts == 1 and backend.sidecars["mamba"].parts == 3
    assert len(backend.sidecars["mamba"].components) == 1
    get = [
        PoolTransfer(name=PoolName.MAMBA, host_indices=mamba.indices([7, 6, 5, 4]), keys=hashes),
        PoolTransfer(name=PoolName.SWA, host_indices=swa.indices([4, 5, 6, 7]), keys=hashes),
        PoolTransfer(name=PoolName.INDEXER, host_indices=swa.indices([8]), keys=hashes[:1]),
    ]
    answers = backend.batch_get_v2(get)
    assert answers == {"mamba": [True] * 4, "swa": [True] * 4, "indexer": [False]}
    for i in range(4):
        assert mamba.slot_bytes(7 - i) == mamba.slot_bytes(i)
        assert swa.page_bytes(4 + i) == swa.page_bytes(i)


def _first(policy: str, end: int, window: int) -> int:
    return 0 if policy == "all_pages" else max(0, end - window)


def oracle(kv: int, pools: list[tuple[set[int], str, int]]) -> list[int]:
    """Every prefix length SGLang may restore: all KV pages before it, and per pool
    every page before it (all_pages) or the last `window` before it (trailing_pages)."""
    ends = []
    for end in range(1, kv + 1):
        if all(
            all(i in present for i in range(_first(policy, end, window), end))
            for present, policy, window in pools
        ):
            ends.append(end)
    return ends


def test_v2_exists_matches_the_oracle(rig: Any, hybrid: Any) -> None:
    PoolName, PoolTransfer, PoolHitPolicy = names()
    backend, kv, mamba, swa = hybrid
    rng = random.Random(34)
    for trial in range(12):
        hashes = rig.page_hashes(N, f"trial{trial}")
        kv_pages = rng.randint(0, N)
        if kv_pages:
            stored = backend.batch_set_v1(hashes[:kv_pages], kv.indices(list(range(kv_pages))))
            assert stored == [True] * kv_pages
        held = {}
        for name, pool in ((PoolName.MAMBA, mamba), (PoolName.SWA, swa)):
            present = {i for i in range(N) if rng.random() < 0.7}
            held[name] = present
            if present:
                pages = sorted(present)
                transfer = PoolTransfer(name=name, host_indices=pool.indices(pages),
                                        keys=[hashes[i] for i in pages])
                assert all(backend.batch_set_v2([transfer])[str(name)])
        window = rng.randint(1, 3)
        swa_policy = rng.choice([PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES])
        trailing = PoolHitPolicy.TRAILING_PAGES
        asked = [
            PoolTransfer(name=PoolName.MAMBA, keys=hashes[-1:], hit_policy=trailing),
            PoolTransfer(name=PoolName.SWA, keys=hashes[-window:], hit_policy=swa_policy),
        ]
        result = backend.batch_exists_v2(hashes, asked)
        ends = oracle(kv_pages, [
            (held[PoolName.MAMBA], "trailing_pages", 1),
            (held[PoolName.SWA], swa_policy.value, window),
        ])
        assert result.restorable_prefix_pages == ends, trial
        assert result.kv_hit_pages == (ends[-1] if ends else 0), trial


def test_v2_after_close_answers_misses(rig: Any, hybrid: Any) -> None:
    PoolName, PoolTransfer, _ = names()
    backend, _kv, mamba, _swa = hybrid
    hashes = rig.page_hashes(2, "closed")
    backend.close()
    transfer = PoolTransfer(name=PoolName.MAMBA, host_indices=mamba.indices([0, 1]), keys=hashes)
    assert backend.batch_set_v2([transfer]) == {"mamba": [False, False]}
    assert backend.batch_get_v2([transfer]) == {"mamba": [False, False]}
    result = backend.batch_exists_v2(hashes, [transfer])
    assert result.kv_hit_pages == 0 and not result.restorable_prefix_pages
