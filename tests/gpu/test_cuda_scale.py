"""On a real GPU (`-m cuda`): a transfer of more than 100k pages, each page its own
copy, through the batched memcpy in bounded driver calls, to and from a primary slab
pinned at its exact size (`cudaHostRegister`, not torch's allocator). Every byte is
checked on the host; the kernel backend moves the same transfer through the slab's
device alias."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tierkv.gpu import TransferSpec, TransferWorker
from tierkv.gpu.cuda_batch import MAX_COPIES_PER_CALL
from tierkv.layout import GroupSpec, KVLayout
from tierkv.primary import PrimaryTier

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]

PAGE = 4096
LAYERS = 32
BLOCKS = 3200  # x 32 layers = 102,400 pages: 400 calls of at most 256 copies
TOKENS = 16


def _setup(copy_backend: Any, dma_executor: Any) -> tuple[TransferWorker, list[torch.Tensor], Any]:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(7)
    kv = [
        torch.randint(0, 256, (2 * BLOCKS, PAGE), dtype=torch.uint8, device=device, generator=gen)
        for _ in range(LAYERS)
    ]
    primary = PrimaryTier(BLOCKS, LAYERS * PAGE, pin_memory=True)
    layout = KVLayout(block_bytes=LAYERS * PAGE, groups=(GroupSpec(block_size=TOKENS),))
    worker = TransferWorker(
        [kv],
        primary.view,
        layout,
        gpu_block_size=TOKENS,
        copy_backend=copy_backend,
        dma_executor=dma_executor,
        ready=torch.cuda.current_stream(device),
    )
    return worker, kv, primary


@pytest.mark.parametrize(
    ("copy_backend", "dma_executor"), [("dma", "batched"), ("kernel", "auto"), ("bounded", "auto")]
)
def test_a_transfer_of_100k_pages_arrives_byte_identical_both_ways(
    copy_backend: Any, dma_executor: Any
) -> None:
    worker, kv, primary = _setup(copy_backend, dma_executor)
    assert primary.memory.pinned_bytes == BLOCKS * LAYERS * PAGE  # exact, not 512 MiB
    assert primary.view.tensor.is_pinned()
    cpu = torch.Generator().manual_seed(3)
    gpu_ids = torch.randperm(2 * BLOCKS, generator=cpu)[:BLOCKS]  # no two pages adjacent
    slots = torch.randperm(BLOCKS, generator=cpu)
    try:
        worker.submit(TransferSpec("store", [gpu_ids], [slots], [0]))
        torch.cuda.synchronize()
        rows = primary.view.tensor.view(BLOCKS, LAYERS, PAGE)
        for layer in range(LAYERS):
            assert torch.equal(rows[slots, layer], kv[layer][gpu_ids.cuda()].cpu()), layer
        expected = [layer[gpu_ids.cuda()].clone() for layer in kv]
        for layer in kv:
            layer.zero_()
        torch.cuda.synchronize()
        worker.submit(TransferSpec("load", [gpu_ids], [slots], [0]))
        torch.cuda.synchronize()
        for layer, want in zip(kv, expected):
            assert torch.equal(layer[gpu_ids.cuda()], want)
        results = worker.get_finished()
        assert [(r.direction, r.backend) for r in results] == [
            ("store", copy_backend),
            ("load", copy_backend),
        ]
        stats = worker.batch_stats
        if copy_backend == "dma":
            assert stats is not None
            pages = BLOCKS * LAYERS
            per_transfer = -(-pages // MAX_COPIES_PER_CALL)
            assert (stats.copies, stats.calls, stats.failed_calls) == (
                2 * pages,
                2 * per_transfer,
                0,
            )
        else:
            assert stats is None
    finally:
        worker.close()
        primary.memory.close()
