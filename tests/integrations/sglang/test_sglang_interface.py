"""The rest of SGLang's storage interface: what the factory refuses, the keys SGLang's
own file backend would use, statistics, clear, close, the legacy and v2 calls, one
event-loop thread per process, and no exception on SGLang's threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tierkv.contract.errors import ConfigError


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tierkv-engine-loop"]


def test_the_factory_refuses_a_config_without_interface_v1(rig: Any) -> None:
    pool = rig.pool(pages=4)
    with pytest.raises(ConfigError, match="interface_v1"):
        rig.backend(pool, [rig.nvme()], interface_v1=0)


def test_unknown_keys_and_bad_tier_fields_name_their_path(rig: Any) -> None:
    pool = rig.pool(pages=4)
    with pytest.raises(ConfigError, match=r"extra_config\.teirs: unknown field"):
        rig.backend(pool, [rig.nvme()], teirs=[])
    with pytest.raises(ConfigError, match=r"extra_config\.tiers\[0\]\.capacity"):
        rig.backend(pool, [rig.nvme(capacity="lots")])
    with pytest.raises(ConfigError, match=r"extra_config\.tiers\[0\]\.write_policy"):
        rig.backend(pool, [rig.nvme(write_policy="write_back")])


def test_mla_across_ranks_needs_a_tier_every_rank_reaches(rig: Any) -> None:
    with pytest.raises(ConfigError, match="TP rank 0 only"):
        rig.backend(rig.pool(pages=4, mla=True), [rig.nvme()], tp_size=2, mla=True)


def test_a_chain_file(rig: Any, tmp_path: Path) -> None:
    chain = tmp_path / "chain.yaml"
    chain.write_text(
        "namespace: tenant-a\n"
        "layout: {block_bytes: 4KiB, groups: [{kind: full, block_size: 16}]}\n"
        "primary: {capacity: 64KiB}\n"
        f"tiers:\n  - {{type: nvme, path: {tmp_path / 'disk'}, capacity: 64MiB}}\n"
    )
    pool = rig.pool(pages=8)
    hicache_storage, backend_factory = rig_sglang()
    config = hicache_storage.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="m", extra_config={**rig_backend(), "chain": str(chain)},
    )
    backend = backend_factory.StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    try:
        assert backend.kv.namespace.startswith("tenant-a|sglang:m:")
        rig.fill(pool, [0], "chain")
        assert backend.batch_set_v1(rig.page_hashes(1), pool.indices([0])) == [True]
        assert backend.batch_get_v1(rig.page_hashes(1), pool.indices([1])) == [True]
        assert pool.page_bytes(1) == pool.page_bytes(0)
    finally:
        backend.close()


def rig_sglang() -> Any:
    from sglang.srt.mem_cache import hicache_storage
    from sglang.srt.mem_cache.storage import backend_factory

    return hicache_storage, backend_factory


def rig_backend() -> dict[str, Any]:
    return {
        "backend_name": "tierkv",
        "module_path": "tierkv.integrations.sglang",
        "class_name": "TierkvHiCacheStorage",
        "interface_v1": 1,
    }


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("pp", [1, 2])
def test_rank_suffix_is_sglang_file_backends(tmp_path: Path, mla: bool, pp: int) -> None:
    """Pages of one rank carry the suffix SGLang's own file backend gives them."""
    hicache_storage, _ = rig_sglang()
    from tierkv.integrations.sglang.settings import rank_suffix

    config = hicache_storage.HiCacheStorageConfig(
        tp_rank=1, tp_size=2, pp_rank=pp - 1, pp_size=pp, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="org/model", extra_config={"file_storage_path": str(tmp_path)},
    )
    theirs = hicache_storage.HiCacheFile(config).config_suffix
    ours = rank_suffix(
        model="org/model", tp_rank=1, tp_size=2, pp_rank=pp - 1, pp_size=pp, is_mla=mla
    )
    assert ours == theirs


def test_stats_clear_close(rig: Any) -> None:
    pool = rig.pool(pages=8)
    backend = rig.backend(pool, [rig.nvme()])
    rig.fill(pool, [0, 1, 2, 3], "stats")
    hashes = rig.page_hashes(4)
    assert backend.batch_set_v1(hashes, pool.indices([0, 1, 2, 3])) == [True] * 4
    assert backend.batch_get_v1(hashes[:2], pool.indices([4, 5])) == [True] * 2
    stats = backend.get_stats()
    assert stats.backup_pgs == [4] and stats.prefetch_pgs == [2]
    assert len(stats.backup_bandwidth) == 1 and len(stats.prefetch_bandwidth) == 1
    assert backend.get_stats().backup_pgs == []  # taken: since the last call
    backend.clear()
    assert backend.batch_exists(hashes) == 0
    backend.close()
    backend.close()
    assert backend.batch_exists(hashes) == 0
    assert backend.batch_get_v1(hashes, pool.indices([4, 5, 6, 7])) == [False] * 4
    assert backend.batch_set_v1(hashes, pool.indices([0, 1, 2, 3])) == [False] * 4


def test_legacy_and_v2_calls_answer_misses(rig: Any) -> None:
    pool = rig.pool(pages=4)
    backend = rig.backend(pool, [rig.nvme()])
    hashes = rig.page_hashes(1)
    page = pool.get_data_page(0)
    assert backend.set(hashes[0], page) is False
    assert backend.batch_set(hashes, [page]) is False
    assert backend.get(hashes[0], pool.get_dummy_flat_data_page()) is None
    assert backend.batch_get(hashes, [pool.get_dummy_flat_data_page()]) == [None]
    assert backend.exists(hashes[0]) is False
    assert backend.batch_set_v1(hashes, pool.indices([0])) == [True]
    assert backend.exists(hashes[0]) is True


def test_a_bad_call_is_a_miss_not_an_exception(rig: Any) -> None:
    pool = rig.pool(pages=4)
    backend = rig.backend(pool, [rig.nvme()])
    hashes = rig.page_hashes(2)
    assert backend.batch_set_v1(hashes, pool.indices([0])) == [False, False]  # 1 page of 2
    assert backend.batch_get_v1(hashes, "not indices") == [False, False]
    assert backend.batch_get_v1(keys=hashes, host_indices="not indices") == [False, False]
    assert backend.batch_set_v2(transfers="not transfers") == {}
    assert backend.batch_exists_v2(hashes, pool_transfers="junk").kv_hit_pages == 0


def test_a_region_that_is_not_a_slot_is_a_miss(rig: Any, monkeypatch: Any) -> None:
    """A page region the pool reports off its slot grid (misaligned, of another size,
    or past the buffer) answers misses for the whole call, and moves no byte."""
    pool = rig.pool(pages=4)
    backend = rig.backend(pool, [rig.nvme()])
    hashes = rig.page_hashes(2)
    rig.fill(pool, [0, 1], "slots")
    assert backend.batch_set_v1(hashes, pool.indices([0, 1])) == [True, True]
    real = pool.get_page_buffer_meta
    before = [pool.page_bytes(p) for p in (2, 3)]
    for bend in ("misaligned", "size", "past the end"):

        def bent(indices: Any, bend: str = bend) -> Any:
            ptrs, sizes = real(indices)
            if bend == "misaligned":
                ptrs = [ptrs[0] + 2, *ptrs[1:]]
            elif bend == "size":
                sizes = [sizes[0] // 2, *sizes[1:]]
            else:
                ptrs = [*ptrs[:-1], ptrs[-1] + 4 * pool.kv_buffer.nbytes]
            return ptrs, sizes

        monkeypatch.setattr(pool, "get_page_buffer_meta", bent)
        assert backend.batch_get_v1(hashes, pool.indices([2, 3])) == [False, False]
        assert [pool.page_bytes(p) for p in (2, 3)] == before
    monkeypatch.setattr(pool, "get_page_buffer_meta", real)
    assert backend.batch_get_v1(hashes, pool.indices([2, 3])) == [True, True]
    assert [pool.page_bytes(p) for p in (2, 3)] == [pool.page_bytes(p) for p in (0, 1)]


def test_one_event_loop_thread_per_process(rig: Any) -> None:
    before = len(loop_threads())
    first = rig.backend(rig.pool(pages=4), [rig.nvme("a")])
    second = rig.backend(rig.pool(pages=4, head_dim=32), [rig.nvme("b")])
    assert len(loop_threads()) == max(before, 1)
    first.close()
    assert len(loop_threads()) == max(before, 1)
    second.close()
    assert len(loop_threads()) == 0
