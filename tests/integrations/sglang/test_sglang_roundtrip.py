"""Pages through SGLang's zero-copy interface and back, byte for byte: every host
layout, MLA with one writer rank, two TP ranks, two threads at once, two servers of one
model sharing pages and two models never sharing them."""

from __future__ import annotations

import threading
from typing import Any

import pytest

PAGES = 8


def stored(rig: Any, backend: Any, pool: Any, hashes: list[str], pages: list[int]) -> None:
    assert backend.batch_set_v1(hashes, pool.indices(pages)) == [True] * len(hashes)


def read_back(backend: Any, pool: Any, hashes: list[str], pages: list[int]) -> list[bool]:
    return backend.batch_get_v1(hashes, pool.indices(pages))


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_pages_round_trip_byte_identical(rig: Any, layout: str, mla: bool) -> None:
    """Written from some host pages of one server, read into other host pages of the
    server after a restart (the nvme tier keeps its pages): every byte equal."""
    hashes = rig.page_hashes(PAGES)
    first = rig.pool(pages=2 * PAGES, layout=layout, mla=mla)
    rig.fill(first, list(range(PAGES)), "a")
    writer = rig.backend(first, [rig.nvme()], mla=mla)
    assert writer.batch_exists(hashes) == 0
    stored(rig, writer, first, hashes, list(range(PAGES)))
    assert writer.batch_exists(hashes) == PAGES
    writer.close()

    second = rig.pool(pages=2 * PAGES, layout=layout, mla=mla)
    reader = rig.backend(second, [rig.nvme()], mla=mla)
    assert reader.batch_exists(hashes) == PAGES
    targets = list(range(PAGES, 2 * PAGES))[::-1]  # other host pages, another order
    assert read_back(reader, second, hashes, targets) == [True] * PAGES
    for src, dst in zip(range(PAGES), targets):
        assert second.page_bytes(dst) == first.page_bytes(src)


def test_leading_pages_only(rig: Any) -> None:
    """`batch_exists` counts the pages present from the start; a gap ends it."""
    pool = rig.pool(pages=PAGES)
    backend = rig.backend(pool, [rig.nvme()])
    hashes = rig.page_hashes(PAGES)
    stored(rig, backend, pool, hashes[:3] + hashes[4:], [0, 1, 2, 4, 5, 6, 7])
    assert backend.batch_exists(hashes) == 3
    assert backend.batch_exists(hashes[4:]) == PAGES - 4
    assert backend.exists(hashes[0]) and not backend.exists(hashes[3])


def test_mla_one_writer_rank(rig: Any, redis_url: str) -> None:
    """MLA pages are the same on every TP rank: rank 1 writes nothing (and says True,
    as SGLang's own backends do); rank 0 writes; rank 1 reads rank 0's pages from the
    tier both reach."""
    hashes = rig.page_hashes(4, "mla")
    pools = [rig.pool(pages=8, mla=True) for _ in range(2)]
    redis = [{"type": "redis", "url": redis_url}]
    ranks = [
        rig.backend(p, redis, tp_rank=r, tp_size=2, mla=True) for r, p in enumerate(pools)
    ]
    rig.fill(pools[1], [0, 1, 2, 3], "rank1")
    assert ranks[1].batch_set_v1(hashes, pools[1].indices([0, 1, 2, 3])) == [True] * 4
    assert ranks[0].batch_exists(hashes) == 0  # the non-writer wrote nothing
    rig.fill(pools[0], [0, 1, 2, 3], "rank0")
    stored(rig, ranks[0], pools[0], hashes, [0, 1, 2, 3])
    assert ranks[1].batch_exists(hashes) == 4
    assert read_back(ranks[1], pools[1], hashes, [4, 5, 6, 7]) == [True] * 4
    for i in range(4):
        assert pools[1].page_bytes(4 + i) == pools[0].page_bytes(i)


def test_two_tp_ranks_keep_their_own_shards(rig: Any) -> None:
    """MHA pages are each rank's head shard: one page hash, two ranks, two contents,
    each rank reads back its own."""
    hashes = rig.page_hashes(4, "tp")
    pools = [rig.pool(pages=8) for _ in range(2)]
    ranks = [rig.backend(p, [rig.nvme()], tp_rank=r, tp_size=2) for r, p in enumerate(pools)]
    for r in range(2):
        rig.fill(pools[r], [0, 1, 2, 3], f"shard{r}")
        stored(rig, ranks[r], pools[r], hashes, [0, 1, 2, 3])
    for r in range(2):
        assert read_back(ranks[r], pools[r], hashes, [4, 5, 6, 7]) == [True] * 4
        for i in range(4):
            assert pools[r].page_bytes(4 + i) == pools[r].page_bytes(i)
    assert pools[0].page_bytes(4) != pools[1].page_bytes(4)


def test_two_servers_share_pages_and_two_models_never(rig: Any, redis_url: str) -> None:
    """Over one shared tier: a second server of the model reads the first one's
    pages; another model, or the same name with other page bytes, sees none."""
    redis = [{"type": "redis", "url": redis_url}]
    pool = rig.pool(pages=8)
    rig.fill(pool, [0, 1, 2, 3], "shared")
    hashes = rig.page_hashes(4)
    stored(rig, rig.backend(pool, redis, model="org/a"), pool, hashes, [0, 1, 2, 3])
    twin_pool = rig.pool(pages=8)
    twin = rig.backend(twin_pool, redis, model="org/a")
    assert twin.batch_exists(hashes) == 4
    assert read_back(twin, twin_pool, hashes, [4, 5, 6, 7]) == [True] * 4
    for i in range(4):
        assert twin_pool.page_bytes(4 + i) == pool.page_bytes(i)
    other = rig.backend(rig.pool(pages=4), redis, model="org/b")
    assert other.batch_exists(hashes) == 0
    wider = rig.backend(rig.pool(pages=4, head_dim=128), redis, model="org/a")
    assert wider.batch_exists(hashes) == 0


def test_two_threads_at_once(rig: Any) -> None:
    """SGLang's backup and I/O threads call at the same time: each gets its own
    pages back, whole."""
    pool = rig.pool(pages=64)
    backend = rig.backend(pool, [rig.nvme()])
    rig.fill(pool, list(range(32)), "threads")
    wrong: list[str] = []

    def worker(t: int) -> None:
        for round_ in range(4):
            src = [t * 16 + round_ * 4 + i for i in range(4)]
            dst = [32 + s for s in src]
            hashes = rig.page_hashes(4, f"t{t}r{round_}")
            if backend.batch_set_v1(hashes, pool.indices(src)) != [True] * 4:
                wrong.append(f"set {t}/{round_}")
            if backend.batch_exists(hashes) != 4:
                wrong.append(f"exists {t}/{round_}")
            if backend.batch_get_v1(hashes, pool.indices(dst)) != [True] * 4:
                wrong.append(f"get {t}/{round_}")
            wrong.extend(
                f"bytes {t}/{round_}/{s}"
                for s, d in zip(src, dst)
                if pool.page_bytes(s) != pool.page_bytes(d)
            )

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert wrong == []


def test_a_page_missing_in_a_get_is_false_and_the_rest_true(rig: Any) -> None:
    pool = rig.pool(pages=8)
    backend = rig.backend(pool, [rig.nvme()])
    rig.fill(pool, [0, 1], "partial")
    hashes = rig.page_hashes(3)
    stored(rig, backend, pool, [hashes[0], hashes[2]], [0, 1])
    assert read_back(backend, pool, hashes, [4, 5, 6]) == [True, False, True]
    assert pool.page_bytes(4) == pool.page_bytes(0)
    assert pool.page_bytes(6) == pool.page_bytes(1)
