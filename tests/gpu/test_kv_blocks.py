"""End to end: engine KV tensors -> store through the cache -> evicted to a secondary
tier -> loaded back into *different* GPU block ids -> byte-identical.

Runs on the CPU device (the same worker code path as CUDA)."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.gpu import TransferWorker, required_block_bytes
from tierkv.gpu.kv_blocks import KVCacheBlocks
from tierkv.gpu.lanes import Launched

pytestmark = pytest.mark.anyio

GPU_BLOCK_TOKENS = 8
FACTOR = 2
NUM_GPU_BLOCKS = 24


def engine_kv(seed: int) -> list[list[torch.Tensor]]:
    """Two groups: full attention (2 layers, 256-byte pages) and sliding window (2 layers,
    128-byte pages), fp16, first dim = GPU block id."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(NUM_GPU_BLOCKS, 128, generator=g).half() for _ in range(2)]
    window = [torch.randn(NUM_GPU_BLOCKS, 64, generator=g).half() for _ in range(2)]
    return [full, window]


def chain(block_bytes: int, primary_blocks: int = 6) -> dict[str, object]:
    return {
        "namespace": "e2e",
        "layout": {
            "block_bytes": block_bytes,
            "groups": [
                {"kind": "full", "block_size": GPU_BLOCK_TOKENS * FACTOR},
                {"kind": "sliding_window", "block_size": GPU_BLOCK_TOKENS * FACTOR, "window": 32},
            ],
        },
        "primary": {"capacity": primary_blocks * block_bytes, "pin_memory": False},
        "tiers": [{"type": "memory"}],
        "promotion_reserve": 1.0,
    }


def request_keys(tokens: list[int]) -> list[list[OffloadKey]]:
    hashes = hash_token_blocks(tokens, GPU_BLOCK_TOKENS * FACTOR, namespace="e2e")
    return [[make_offload_key(h, g) for h in hashes] for g in range(2)]


def blocks_of(kv: list[list[torch.Tensor]], group: int, ids: list[int]) -> list[bytes]:
    return [b"".join(bytes(layer[i].view(torch.uint8).numpy()) for layer in kv[group]) for i in ids]


@pytest.mark.parametrize("copy_backend", ["kernel", "dma"])
async def test_kv_round_trip_through_a_secondary_tier_into_other_gpu_blocks(
    copy_backend: Any,
) -> None:
    kv = engine_kv(0)
    block_bytes = required_block_bytes(kv, FACTOR)
    config = parse_config(chain(block_bytes))
    async with TieredCache(config) as cache:
        worker = TransferWorker(
            kv,
            cache.primary.view,
            config.layout,
            gpu_block_size=GPU_BLOCK_TOKENS,
            copy_backend=copy_backend,
        )
        tokens = list(range(1000, 1048))  # 48 tokens = 6 GPU blocks = 3 offloaded blocks
        keys = request_keys(tokens)
        src_ids = [[3, 17, 5, 9, 0, 11], [2, 4, 6, 8, 10, 12]]
        before = {g: blocks_of(kv, g, src_ids[g]) for g in range(2)}
        result = await cache.store(keys[0] + keys[1], KVCacheBlocks(worker, src_ids))
        assert result.ok and len(result.stored) == 6
        await cache.flush()

        # push everything out of the primary with unrelated blocks
        filler = request_keys(list(range(5000, 5048)))
        await cache.store(filler[0] + filler[1], KVCacheBlocks(worker, [[1] * 6, [1] * 6]))
        await cache.flush()
        assert not any(cache.primary.is_ready(k) for k in keys[0] + keys[1])

        hit = await cache.lookup(keys)
        assert hit.hit_tokens == 48
        assert set(hit.locations.values()) == {"memory"}
        # the window group needs only the blocks inside its window before token 48
        assert hit.group_keys[1] == tuple(keys[1][-2:])

        dst_ids = [[20, 21, 22, 23, 18, 19], [13, 14, 15, 16]]
        dest = KVCacheBlocks(worker, dst_ids, block_indices=[0, 2])  # window starts at GPU block 2
        loaded = await cache.load(hit.keys_to_load, dest)
        assert loaded.ok, loaded.errors
        assert set(loaded.sources.values()) == {"memory"}
        assert blocks_of(kv, 0, dst_ids[0]) == before[0]
        assert blocks_of(kv, 1, dst_ids[1]) == before[1][2:]


@pytest.mark.parametrize("copy_backend", ["kernel", "dma"])
async def test_store_of_partly_cached_requests_moves_only_new_blocks_in_one_submission(
    copy_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = engine_kv(1)
    block_bytes = required_block_bytes(kv, FACTOR)
    # 24 slots: the store's 5 new blocks fit the room stores leave promotions (a quarter
    # of the primary at promotion_reserve 1.0), so they are one window
    config = parse_config(chain(block_bytes, primary_blocks=24))
    async with TieredCache(config) as cache:
        worker = TransferWorker(
            kv,
            cache.primary.view,
            config.layout,
            gpu_block_size=GPU_BLOCK_TOKENS,
            copy_backend=copy_backend,
        )
        submissions: list[int] = []
        start = worker.start

        async def counted(spec: Any, *, ready: Any = None) -> Any:
            submissions.append(len(spec))
            return await start(spec, ready=ready)

        monkeypatch.setattr(worker, "start", counted)
        keys = request_keys(list(range(48)))
        ids = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
        # the middle block of group 0 is cached already: the rest is three runs
        middle = KVCacheBlocks(worker, [[2, 3], []], block_indices=[2, 0])
        assert (await cache.store([keys[0][1]], middle)).ok
        submissions.clear()
        result = await cache.store(keys[0] + keys[1], KVCacheBlocks(worker, ids))
        assert submissions == [3]  # runs 0, 2 of group 0 and 0..2 of group 1: one submission
        assert result.already_present == (keys[0][1],) and len(result.stored) == 5
        for g in range(2):
            for j, key in enumerate(keys[g]):
                slot = cache.primary.slot_of(key)
                assert slot is not None
                want = b"".join(blocks_of(kv, g, ids[g][2 * j : 2 * j + 2]))
                row = bytes(cache.primary.view.block(slot))
                stride = block_bytes // FACTOR
                used = len(want) // 2
                assert row[:used] + row[stride : stride + used] == want


def test_adapter_checks_its_shape() -> None:
    kv = engine_kv(2)
    block_bytes = required_block_bytes(kv, FACTOR)
    config = parse_config(chain(block_bytes))
    from tierkv.primary import PrimaryTier

    primary = PrimaryTier(6, block_bytes, pin_memory=False)
    worker = TransferWorker(kv, primary.view, config.layout, gpu_block_size=GPU_BLOCK_TOKENS)
    with pytest.raises(ValueError, match="gpu_blocks has 1 groups; the worker has 2"):
        KVCacheBlocks(worker, [[0, 1]])
    with pytest.raises(ValueError, match="block_indices has 1 entries for 2 groups"):
        KVCacheBlocks(worker, [[0], [1]], block_indices=[0])
    blocks = KVCacheBlocks(worker, [[0, 1, 2], [4]], block_indices=[1, 0])
    assert blocks.keys_per_group() == [2, 1] and len(blocks) == 3


class _QueuedCopy:
    """A copy that lands when the 'device' gets to it, like a kernel on a stream: the
    worker's completion thread waits for the device to be idle, then it runs."""

    event = None

    def __init__(self, run: Any, idle: threading.Event) -> None:
        self.run, self.idle, self.done = run, idle, threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def started(self) -> bool:
        return self.done.is_set()  # queued until the completion thread runs it

    def wait(self) -> None:
        self.idle.wait()
        self.run()
        self.done.set()

    def seconds(self) -> float:
        return 0.0


async def test_a_cancelled_store_cannot_free_slots_a_queued_copy_still_writes() -> None:
    """Emulates CUDA's asynchronous copies on CPU: a store is cancelled while its copy
    into the slot is still queued. The slot must not be reused before the copy lands,
    or a later promotion of another key would be overwritten with this key's KV."""
    idle = threading.Event()
    idle.set()

    class QueuedWorker(TransferWorker):
        def _launch(self, mapping: Any, lane: Any) -> Launched:
            if mapping.direction == "store":
                kernel = self._backends.small
                assert kernel is not None
                run = lambda: kernel.enqueue(mapping, None, None)  # noqa: E731
                return Launched(_QueuedCopy(run, idle), (), "kernel")
            return super()._launch(mapping, lane)

    kv = [[torch.zeros(8, 32, dtype=torch.int16)]]
    kv[0][0][0] = 111  # request A's KV
    kv[0][0][1] = 222  # block B's KV
    block_bytes = required_block_bytes(kv, 1)
    config = parse_config(
        {
            "namespace": "t",
            "layout": {"block_bytes": block_bytes, "groups": [{"block_size": 16}]},
            "primary": {"capacity": 2 * block_bytes, "pin_memory": False},
            "tiers": [{"type": "memory"}],
        }
    )
    a, b = make_offload_key(b"A" * 16, 0), make_offload_key(b"B" * 16, 0)
    fillers = [make_offload_key(bytes([i]) * 16, 0) for i in range(2)]
    async with TieredCache(config) as cache:
        worker = QueuedWorker(kv, cache.primary.view, config.layout, gpu_block_size=16)
        await cache.store([b], KVCacheBlocks(worker, [[1]]))
        await cache.flush()
        for i, filler in enumerate(fillers):  # B leaves the primary
            await cache.store([filler], KVCacheBlocks(worker, [[2 + i]]))
            await cache.flush()
        assert b not in cache.primary
        idle.clear()

        async def device_catches_up() -> None:
            await anyio.sleep(0.2)
            idle.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(device_catches_up)
            with anyio.move_on_after(0.05):  # request A is aborted mid-store
                await cache.store([a], KVCacheBlocks(worker, [[0]]))
        await cache.flush()
        for target in (5, 6):  # B promoted, then served from the primary
            result = await cache.load([b], KVCacheBlocks(worker, [[target]]))
            assert result.ok
            assert kv[0][0][target][:3].tolist() == [222, 222, 222]


async def test_a_store_must_cover_whole_offloaded_blocks() -> None:
    kv = engine_kv(3)
    block_bytes = required_block_bytes(kv, FACTOR)
    config = parse_config(chain(block_bytes))
    async with TieredCache(config) as cache:
        worker = TransferWorker(
            kv, cache.primary.view, config.layout, gpu_block_size=GPU_BLOCK_TOKENS
        )
        keys = request_keys(list(range(32)))
        # starts in the middle of its first offloaded block: sub-block 0 would be stale
        partial = KVCacheBlocks(worker, [[4, 5, 6], []], block_indices=[1, 0])
        with pytest.raises(ValueError, match="a store must cover whole offloaded blocks"):
            await cache.store(keys[0][:2], partial)
        assert len(cache.primary) == 0 and cache.primary.num_free == 6  # nothing kept
