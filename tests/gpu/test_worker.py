"""The transfer worker moves exactly the bytes a spec names, between GPU KV caches and
primary slab rows laid out as documented in `tierkv.gpu.geometry`, and nothing else.

Every data test compares the whole destination and the whole source with what a
straightforward reference (a loop over sub-blocks and layers, written from the
documented row layout) says they must hold afterwards: mapped sub-blocks copied,
everything else, padding included, unchanged. The tests run on the CPU device and,
unchanged, on CUDA where a device exists (`-m cuda`), for each copy backend: `kernel`
(gather/scatter), `dma` (the DMA plan's triples, applied on CPU by `memmove`, on CUDA by
the batched memcpy), `dma-runs` (the same triples as one `copy_` per run), `bounded`
(the Triton page-copy kernel: on CPU under Triton's interpreter) and `auto`.
"""

from __future__ import annotations

import operator
import os
import random
import threading
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.contract.errors import ConfigError
from tierkv.gpu import (
    DIRECTIONS,
    Direction,
    TransferResult,
    TransferSpec,
    TransferSpecError,
    TransferWorker,
    required_block_bytes,
)
from tierkv.gpu.bounded import triton_missing
from tierkv.gpu.lanes import Launched
from tierkv.layout import GroupSpec, KVLayout
from tierkv.primary import HostSlab, PrimaryTier

pytestmark = pytest.mark.anyio

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")],
    ),
]
GPU_BLOCK = 4  # tokens per GPU block in every test layout
COPIES = {  # id -> (copy_backend, dma_executor)
    "kernel": ("kernel", "auto"),
    "dma": ("dma", "auto"),
    "dma-runs": ("dma", "runs"),
    "bounded": ("bounded", "auto"),  # on CPU: the Triton kernel under its interpreter
    "auto": ("auto", "auto"),
}
Copy = tuple[Any, Any]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(params=list(COPIES))
def copy(request: pytest.FixtureRequest) -> Copy:
    if request.param == "bounded":
        need_triton()
    return COPIES[request.param]


def need_triton() -> None:
    """The bounded backend's tests need Triton (requirements-sglang.txt installs it;
    CI must have it: there a missing Triton fails rather than skips)."""
    if triton_missing() is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the bounded copy kernel cannot be tested: {triton_missing()}")
        pytest.skip(str(triton_missing()))


def ready_for(device: torch.device) -> Any:
    """CUDA: the test writes KV on the current stream, so transfers wait on it."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


# -- building blocks ------------------------------------------------------------------
_DTYPES = (torch.uint8, torch.float16, torch.float32, torch.bfloat16)


def make_layer(num_blocks: int, page: int, which: int, gen: torch.Generator) -> torch.Tensor:
    """A per-layer KV tensor of `page` random bytes per block; dtype and shape vary
    with `which` so the worker sees more than uint8 [blocks, bytes]."""
    raw = torch.randint(0, 256, (num_blocks, page), dtype=torch.uint8, generator=gen)
    dtype = _DTYPES[which % len(_DTYPES)]
    size = torch.empty(0, dtype=dtype).element_size()
    if page % (2 * size):
        return raw
    return raw.view(dtype).view(num_blocks, 2, page // (2 * size))


class Rig:
    """KV caches, a primary slab and a worker over them, plus the reference."""

    def __init__(
        self,
        device: torch.device,
        pages: Sequence[Sequence[int]],
        *,
        factor: int,
        num_gpu_blocks: int | Sequence[int] = 12,
        num_slots: int = 8,
        seed: int = 0,
        kv: list[list[torch.Tensor]] | None = None,
        copy: Copy = COPIES["kernel"],
        **worker_options: Any,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks = (
            [num_gpu_blocks] * len(pages) if isinstance(num_gpu_blocks, int) else num_gpu_blocks
        )
        self.pages = [list(p) for p in pages]
        self.factor = factor
        self.copy = copy
        self.kv = kv or [
            [make_layer(nb, page, g + i, gen).to(device) for i, page in enumerate(group)]
            for g, (group, nb) in enumerate(zip(pages, blocks))
        ]
        self.block_bytes = required_block_bytes(self.kv, factor)
        self.stride = self.block_bytes // factor
        slab = torch.randint(
            0, 256, (num_slots, self.block_bytes), dtype=torch.uint8, generator=gen
        )
        layout = KVLayout(
            block_bytes=self.block_bytes,
            groups=tuple(GroupSpec(block_size=GPU_BLOCK * factor) for _ in pages),
        )
        self.primary = PrimaryTier(num_slots, self.block_bytes)
        self.primary.view.tensor.copy_(slab)
        self.worker = TransferWorker(
            self.kv,
            self.primary.view,
            layout,
            gpu_block_size=GPU_BLOCK,
            copy_backend=copy[0],
            dma_executor=copy[1],
            ready=ready_for(device),
            **worker_options,
        )

    @property
    def slab(self) -> torch.Tensor:
        return self.primary.view.tensor

    def snapshot(self) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
        """Host byte copies of every KV tensor (`[blocks, page]`) and of the slab."""
        kv = [[as_bytes(t) for t in group] for group in self.kv]
        return kv, self.slab.clone()

    def expected(
        self, spec: TransferSpec, before: tuple[list[list[torch.Tensor]], torch.Tensor]
    ) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
        """What KV and slab must hold after `spec`, from the documented row layout."""
        kv = [[t.clone() for t in group] for group in before[0]]
        slab = before[1].clone()
        for g, pages in enumerate(self.pages):
            head = operator.index(spec.block_indices[g]) % self.factor
            slots = [int(s) for s in spec.slots[g]]
            for k, gpu_block in enumerate(int(b) for b in spec.gpu_blocks[g]):
                position = head + k
                slot, sub = slots[position // self.factor], position % self.factor
                offset = sub * self.stride
                for layer, page in enumerate(pages):
                    row = slice(offset, offset + page)
                    if spec.direction == "store":
                        slab[slot, row] = before[0][g][layer][gpu_block]
                    else:
                        kv[g][layer][gpu_block] = before[1][slot, row]
                    offset += page
        return kv, slab

    def assert_holds(self, expected: tuple[list[list[torch.Tensor]], torch.Tensor]) -> None:
        kv, slab = self.snapshot()
        for g, group in enumerate(expected[0]):
            for layer, want in enumerate(group):
                assert_bytes_equal(kv[g][layer], want, f"kv_caches[{g}][{layer}]")
        assert_bytes_equal(slab, expected[1], "slab")

    def bytes_of(self, spec: TransferSpec) -> int:
        return sum(len(spec.gpu_blocks[g]) * sum(p) for g, p in enumerate(self.pages))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    host = t.detach().cpu().contiguous()
    return host.view(torch.uint8).reshape(host.shape[0], -1).clone()


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if torch.equal(actual, expected):
        return
    rows = (actual != expected).any(dim=1).nonzero().flatten().tolist()
    cols = (actual[rows[0]] != expected[rows[0]]).nonzero().flatten().tolist()
    raise AssertionError(
        f"{what}: rows {rows[:10]} differ; row {rows[0]} first at byte {cols[0]} "
        f"({len(cols)} bytes differ)"
    )


def pick(n: int, limit: int, rng: random.Random) -> list[int]:
    return rng.sample(range(limit), n)


async def run(rig: Rig, spec: TransferSpec) -> TransferResult:
    before = rig.snapshot()
    result = await rig.worker.transfer(spec)
    return check(rig, spec, before, result)


def check(
    rig: Rig,
    spec: TransferSpec,
    before: tuple[list[list[torch.Tensor]], torch.Tensor],
    result: TransferResult,
) -> TransferResult:
    rig.assert_holds(rig.expected(spec, before))
    assert result.direction == spec.direction
    assert result.num_blocks == sum(len(ids) for ids in spec.gpu_blocks)
    assert result.num_bytes == rig.bytes_of(spec)
    assert result.seconds >= 0
    if rig.copy[0] != "auto":
        assert result.backend == rig.copy[0]
    return result


# -- data movement ----------------------------------------------------------------------
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("page", [512, 1024])
@pytest.mark.parametrize("factor", [1, 3])
async def test_single_group_moves_exactly_the_mapped_sub_blocks(
    device: torch.device, copy: Copy, direction: Direction, page: int, factor: int
) -> None:
    """The first factor-1 sub-blocks of the first slot are skipped, and with factor 3
    the tail of the last slot too; all else stays as it was."""
    num_layers = 3
    rig = Rig(device, [[page] * num_layers], factor=factor, seed=page + factor, copy=copy)
    rng = random.Random(factor)
    n = 5
    head = factor - 1
    spans = -(-(head + n) // factor)
    spec = TransferSpec(direction, [pick(n, 12, rng)], [pick(spans, 8, rng)], block_indices=[head])
    result = await run(rig, spec)
    assert result.num_bytes == n * num_layers * page
    # a second, full-block transfer in the same direction lands as well
    full = TransferSpec(direction, [pick(factor, 12, rng)], [pick(1, 8, rng)], [0])
    await run(rig, full)


@pytest.mark.parametrize("direction", ["store", "load"])
async def test_three_groups_with_an_empty_group_and_head_and_tail_trimming(
    device: torch.device, copy: Copy, direction: Direction
) -> None:
    """A hybrid layout: the groups' bytes per GPU block differ (1024, 768, 512), so
    groups 1 and 2 leave padding in every chunk; group 1 moves nothing; group 2 starts
    at sub-block 1 of its first block and ends at sub-block 1 of its second."""
    factor = 4
    pages = [[512, 512], [512, 256], [256, 256]]
    rig = Rig(device, pages, factor=factor, num_gpu_blocks=[16, 8, 12], num_slots=6, copy=copy)
    assert rig.block_bytes == 4 * 1024
    spec = TransferSpec(
        direction,
        gpu_blocks=[[3, 0, 15, 7, 8, 1, 12, 9], [], [11, 2, 5, 0, 6]],
        slots=[[4, 1], [], [0, 5]],
        block_indices=[0, 0, 3 * factor + 1],
    )
    result = await run(rig, spec)
    assert result.num_bytes == 8 * 1024 + 5 * 512
    assert result.num_blocks == 13


async def test_block_index_counts_only_modulo_the_factor(device: torch.device, copy: Copy) -> None:
    rig = Rig(device, [[64, 32]], factor=2, copy=copy)
    near = TransferSpec("store", [[0, 1, 2]], [[6, 7]], [1])
    far = TransferSpec("store", [[3, 4, 5]], [[0, 1]], [41])
    await run(rig, near)
    await run(rig, far)


async def test_ids_may_be_tensors_or_numpy_arrays(device: torch.device, copy: Copy) -> None:
    rig = Rig(device, [[128]], factor=2, copy=copy)
    spec = TransferSpec(
        "store", [torch.tensor([5, 6, 7, 8])], [np.array([3, 2], dtype=np.int32)], [0]
    )
    await run(rig, spec)
    back = TransferSpec("load", [range(4)], [(3, 2)], [np.int64(0)])
    await run(rig, back)


@pytest.mark.parametrize("copy_id", ["kernel", "dma", "dma-runs", "bounded"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_specs_land_exactly_where_the_mapping_says(
    copy_id: str, data: st.DataObject
) -> None:
    """Random geometry (odd page sizes too, so narrow copy words are used) and random
    specs: the bytes land where the layout says and nothing else changes, through each
    backend (for `dma`, the DMA plan's triples applied by `memmove`). (On the CPU a
    submitted copy is complete when `submit` returns.)"""
    factor = data.draw(st.integers(1, 4), label="factor")
    pages = data.draw(
        st.lists(
            st.lists(st.sampled_from([3, 8, 24, 40, 64, 256]), min_size=1, max_size=3),
            min_size=1,
            max_size=3,
        ),
        label="pages",
    )
    blocks = data.draw(
        st.lists(st.integers(1, 10), min_size=len(pages), max_size=len(pages)), label="blocks"
    )
    num_slots = data.draw(st.integers(1, 8), label="num_slots")
    if copy_id == "bounded":
        need_triton()
    rig = Rig(
        torch.device("cpu"),
        pages,
        factor=factor,
        num_gpu_blocks=blocks,
        num_slots=num_slots,
        seed=data.draw(st.integers(0, 2**16), label="seed"),
        copy=COPIES[copy_id],
    )
    direction = data.draw(st.sampled_from(DIRECTIONS), label="direction")
    free = list(range(num_slots))
    gpu_blocks, slots, indices = [], [], []
    for g in range(len(pages)):
        head = data.draw(st.integers(0, factor - 1))
        index = head + factor * data.draw(st.integers(0, 5))
        most = min(blocks[g], len(free) * factor - head)  # slots are unique in a spec
        n = data.draw(st.integers(0, max(most, 0)))
        spans = -(-(head + n) // factor) if n else 0
        if direction == "load":
            ids = data.draw(st.permutations(range(blocks[g])))[:n]
        else:  # a store may read one GPU block twice
            ids = data.draw(st.lists(st.integers(0, blocks[g] - 1), min_size=n, max_size=n))
        chosen = data.draw(st.permutations(free))[:spans]
        free = [s for s in free if s not in chosen]
        gpu_blocks.append(ids)
        slots.append(chosen)
        indices.append(index)
    spec = TransferSpec(direction, gpu_blocks, slots, indices)
    before = rig.snapshot()
    handle = rig.worker.submit(spec)
    [result] = rig.worker.get_finished()
    assert handle.result is result
    check(rig, spec, before, result)


@pytest.mark.parametrize("direction", ["store", "load"])
async def test_engine_shaped_caches_views_with_offsets_and_strided_blocks(
    device: torch.device, copy: Copy, direction: Direction
) -> None:
    """K and V stacked in front of the block dimension (`[2, blocks, tokens, heads,
    dim]`, passed as two layers, the second at a storage offset) and a cross-layer
    cache (`[blocks, layers, page]`, each layer a view whose blocks are strided
    apart)."""
    gen = torch.Generator().manual_seed(7)
    stacked = torch.randn(2, 10, GPU_BLOCK, 2, 16, generator=gen).to(torch.float16)
    cross = torch.randint(0, 256, (10, 3, 96), dtype=torch.uint8, generator=gen)
    stacked, cross = stacked.to(device), cross.to(device)
    kv = [[stacked[0], stacked[1]], [cross[:, i] for i in range(3)]]
    assert kv[0][1].storage_offset() > 0 and kv[1][2].stride(0) == 3 * 96
    rig = Rig(device, [[256, 256], [96, 96, 96]], factor=2, kv=kv, copy=copy)
    spec = TransferSpec(direction, [[9, 0, 4], [1, 8]], [[3, 5], [0]], [1, 0])
    await run(rig, spec)


async def test_every_bit_pattern_survives_a_round_trip(device: torch.device, copy: Copy) -> None:
    """Blocks move as wide integer or complex words; NaN payloads (signalling ones
    too), negative zero and subnormals must come back bit for bit."""
    patterns = torch.tensor(
        [0x7FF0000000000001, 0x7FF8DEADBEEF0001, -0x8000000000000000, 1, -1, 0x7FF0000000000000],
        dtype=torch.int64,
    )
    layer = patterns.repeat(64).view(6, 8, 8).view(torch.float64)
    other = torch.zeros(6, 128, dtype=torch.uint8)
    original = layer.view(torch.int64).clone()
    rig = Rig(device, [[512, 128]], factor=2, kv=[[layer.to(device), other.to(device)]], copy=copy)
    await run(rig, TransferSpec("store", [[0, 1, 2, 3]], [[1, 0]], [0]))
    await run(rig, TransferSpec("load", [[5, 4]], [[1]], [0]))
    assert torch.equal(rig.kv[0][0][4].cpu().view(torch.int64), original[1])  # sub-block 1


def test_byte_range_and_required_block_bytes_follow_the_documented_layout() -> None:
    rig = Rig(torch.device("cpu"), [[512, 256], [128]], factor=3)
    worker = rig.worker
    assert worker.block_size_factor == 3
    assert worker.block_bytes == 3 * 768 == rig.block_bytes
    assert worker.sub_block_stride == 768
    assert worker.page_bytes == ((512, 256), (128,))
    assert worker.num_gpu_blocks == (12, 12)
    assert worker.num_slots == 8
    assert worker.byte_range(0, 0, 0) == (0, 512)
    assert worker.byte_range(0, 1, 2) == (2 * 768 + 512, 3 * 768)
    assert worker.byte_range(1, 0, 1) == (768, 768 + 128)
    with pytest.raises(IndexError):
        worker.byte_range(0, 0, 3)


def test_a_raw_slab_tensor_works_like_a_primary_view() -> None:
    kv = [[torch.zeros(4, 64, dtype=torch.uint8)]]
    slab = torch.zeros(2, 64, dtype=torch.uint8)
    layout = KVLayout(block_bytes=64, groups=(GroupSpec(block_size=GPU_BLOCK),))
    worker = TransferWorker(kv, slab, layout, gpu_block_size=[GPU_BLOCK])
    kv[0][0][2] = 7
    worker.submit(TransferSpec("store", [[2]], [[1]], [0]))
    assert int(slab[1].sum()) == 7 * 64
    view_worker = TransferWorker(kv, HostSlab(slab, "ns"), layout, gpu_block_size=GPU_BLOCK)
    assert view_worker.num_slots == 2


def test_a_worker_serves_the_slab_it_was_built_over_and_no_other() -> None:
    """`serves` is what `KVCacheBlocks` checks before a copy: the worker's own slab (as
    the `HostSlab` it was given, its tensor, or another view object over that memory),
    never a slab of the same shape elsewhere nor its memory under another shape."""
    kv = [[torch.zeros(4, 64, dtype=torch.uint8)]]
    layout = KVLayout(block_bytes=64, groups=(GroupSpec(block_size=GPU_BLOCK),))
    primary = PrimaryTier(num_blocks=3, block_bytes=64)
    worker = TransferWorker(kv, primary.view, layout, gpu_block_size=GPU_BLOCK)
    slab = primary.view.tensor
    assert worker.serves(primary.view)
    assert worker.serves(slab)
    assert worker.serves(HostSlab(slab, "another namespace"))  # same memory, same rows
    other = PrimaryTier(num_blocks=3, block_bytes=64)  # same shape, other memory
    assert not worker.serves(other.view)
    assert not worker.serves(other.view.tensor)
    assert not worker.serves(slab[:2])  # starts at the same byte, fewer slots
    assert not worker.serves(slab.view(6, 32))  # the same bytes as other rows

    raw = torch.zeros(3, 64, dtype=torch.uint8)
    raw_worker = TransferWorker(kv, raw, layout, gpu_block_size=GPU_BLOCK)
    assert raw_worker.serves(raw)
    assert raw_worker.serves(HostSlab(raw, "ns"))
    assert not raw_worker.serves(slab)


# -- layout checks at construction ----------------------------------------------------
def _layers(*pages: int, blocks: int = 8) -> list[torch.Tensor]:
    return [torch.zeros(blocks, page, dtype=torch.uint8) for page in pages]


_GOOD: dict[str, Any] = {
    "kv": [_layers(512, 512)],
    "slab": torch.zeros(4, 2048, dtype=torch.uint8),
    "block_bytes": 2048,
    "block_sizes": [2 * GPU_BLOCK],
}

BAD_LAYOUTS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "slab of floats": (
        {"slab": torch.zeros(4, 512, dtype=torch.float32)},
        ["slab must be uint8, got dtype torch.float32"],
    ),
    "slab not 2-D": ({"slab": torch.zeros(4 * 2048, dtype=torch.uint8)}, ["contiguous"]),
    "slab rows too short": (
        {"slab": torch.zeros(4, 1024, dtype=torch.uint8)},
        ["slab rows are 1024 bytes but layout.block_bytes is 2048"],
    ),
    "strided inside a block": (
        {"kv": [[torch.zeros(8, 1024, dtype=torch.uint8)[:, ::2]] * 2]},
        ["kv_caches[0][0]: each block must be contiguous"],
    ),
    "transposed layer": (
        {"kv": [[torch.zeros(512, 8, dtype=torch.uint8).t(), _layers(512)[0]]]},
        ["kv_caches[0][0]: each block must be contiguous"],
    ),
    "overlapping blocks": (
        {"kv": [[torch.zeros(4096, dtype=torch.uint8).as_strided((8, 512), (256, 1))] * 2]},
        ["blocks must not overlap"],
    ),
    "bool layer": (
        {"kv": [[torch.zeros(8, 512, dtype=torch.bool)] * 2]},
        ["kv_caches[0][0]: dtype torch.bool"],
    ),
    "not a tensor": ({"kv": [["cache", _layers(512)[0]]]}, ["expected a torch.Tensor, got str"]),
    "no block dimension": (
        {"kv": [[torch.tensor(1.0), _layers(512)[0]]]},
        ["has no block dimension"],
    ),
    "group without layers": ({"kv": [[]]}, ["kv_caches[0]: a group needs at least one layer"]),
    "one tensor for all": ({"kv": torch.zeros(2, 8, 512)}, ["kv_caches: expected one list"]),
    "layers disagree on blocks": (
        {"kv": [[*_layers(512), *_layers(512, blocks=6)]]},
        ["different numbers of GPU blocks [8, 6]"],
    ),
    "more groups than the layout": (
        {"kv": [_layers(512, 512), _layers(512)]},
        ["kv_caches: 2 groups, but the layout has 1"],
    ),
    "block_bytes too small": (
        {"block_bytes": 1024, "slab": torch.zeros(4, 1024, dtype=torch.uint8)},
        ["layout.block_bytes: 1KiB does not add up", "set layout.block_bytes to 2KiB"],
    ),
    "block_bytes too large": (
        {"block_bytes": 4096, "slab": torch.zeros(4, 4096, dtype=torch.uint8)},
        ["block_size_factor 2 x 1024 bytes per GPU block", "set layout.block_bytes to 2KiB"],
    ),
    "offloaded block not a whole number of GPU blocks": (
        {"block_sizes": [6]},
        ["layout.groups[0].block_size: 6 tokens is not a multiple of the GPU block size 4"],
    ),
    "factor differs between groups": (
        {"kv": [_layers(512, 512), _layers(256)], "block_sizes": [8, 12]},
        ["block_size_factor (offloaded / GPU block size) differs between groups: [2, 3]"],
    ),
    "several problems at once": (
        {"slab": torch.zeros(4, 2048, dtype=torch.int16), "kv": [[]]},
        ["slab must be uint8", "a group needs at least one layer"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_LAYOUTS))
def test_layout_mismatch_is_a_clear_config_error(case: str) -> None:
    changes, fragments = BAD_LAYOUTS[case]
    args = {**_GOOD, **changes}
    layout = KVLayout(
        block_bytes=args["block_bytes"],
        groups=tuple(GroupSpec(block_size=b) for b in args["block_sizes"]),
    )
    with pytest.raises(ConfigError) as info:
        TransferWorker(args["kv"], args["slab"], layout, gpu_block_size=GPU_BLOCK)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_good_layout_of_the_table_above_is_accepted() -> None:
    layout = KVLayout(block_bytes=2048, groups=(GroupSpec(block_size=2 * GPU_BLOCK),))
    worker = TransferWorker(_GOOD["kv"], _GOOD["slab"], layout, gpu_block_size=GPU_BLOCK)
    assert worker.block_size_factor == 2


def test_bad_gpu_block_size_is_a_config_error() -> None:
    layout = KVLayout(block_bytes=2048, groups=(GroupSpec(block_size=8),))
    for bad in (0, [4, 4], True):
        with pytest.raises(ConfigError, match="gpu_block_size"):
            TransferWorker(_GOOD["kv"], _GOOD["slab"], layout, gpu_block_size=bad)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_worker_needs_a_pinned_slab() -> None:
    kv = [[torch.zeros(8, 512, dtype=torch.uint8, device="cuda")]]
    layout = KVLayout(block_bytes=512, groups=(GroupSpec(block_size=GPU_BLOCK),))
    with pytest.raises(ConfigError, match="not pinned"):
        TransferWorker(kv, torch.zeros(4, 512, dtype=torch.uint8), layout, gpu_block_size=4)


# -- bad specs --------------------------------------------------------------------------
def _spec(direction: Direction = "store", **groups: Any) -> TransferSpec:
    """Two groups; group 0 is always valid, group 1 from the arguments."""
    return TransferSpec(
        direction,
        [[0, 1], groups.get("gpu", [2, 3, 4])],
        [[0], groups.get("slots", [1, 2])],
        [0, groups.get("index", 0)],
    )


BAD_SPECS: dict[str, tuple[Any, str]] = {
    "one group too few": (
        lambda: TransferSpec("store", [[0, 1]], [[0]], [0]),
        "the spec names 1 groups but the worker has 2",
    ),
    "slot out of range": (lambda: _spec(slots=[1, 6]), r"slots\[1\]: 6 is out of range 0..5"),
    "negative slot": (lambda: _spec(slots=[-1, 2]), r"slots\[1\]: -1 is out of range"),
    "GPU block out of range": (
        lambda: _spec(gpu=[2, 3, 12]),
        r"gpu_blocks\[1\]: 12 is out of range 0..11",
    ),
    "negative GPU block": (lambda: _spec(gpu=[-3, 3, 4]), r"gpu_blocks\[1\]: -3 is out"),
    "too few slots for the blocks": (
        lambda: _spec(slots=[1]),
        r"group 1: 3 GPU blocks starting at sub-block 0 .* span 2 offloaded blocks, "
        r"but 1 slots were given",
    ),
    "too many slots for the blocks": (lambda: _spec(slots=[1, 2, 3]), "span 2 offloaded"),
    "head offset needs another slot": (
        lambda: _spec(gpu=[2, 3], slots=[1], index=5),
        r"starting at sub-block 1 \(block_indices\[1\]=5 % block_size_factor 2\) span 2",
    ),
    "slots for an empty group": (lambda: _spec(gpu=[], slots=[1]), "span 0 offloaded"),
    "negative block index": (lambda: _spec(index=-1), "block_indices.1. must be a non-negative"),
    "float block index": (lambda: _spec(index=1.0), "block_indices.1. must be a non-negative"),
    "bool block index": (lambda: _spec(index=True), "block_indices.1. must be a non-negative"),
    "float ids": (lambda: _spec(gpu=[2.0, 3.0, 4.0]), "expected a 1-D sequence of ints"),
    "nested ids": (lambda: _spec(gpu=[[2, 3, 4]]), "expected a 1-D sequence of ints"),
    "text ids": (lambda: _spec(gpu=["a", "b", "c"]), "not a sequence of ints"),
    "store writes a slot twice": (lambda: _spec(slots=[1, 1]), "a slot appears twice"),
    "store writes a slot of another group": (
        lambda: _spec(slots=[2, 0]),
        "a slot appears twice",
    ),
    "load writes a GPU block twice": (
        lambda: _spec("load", gpu=[2, 3, 2]),
        r"gpu_blocks\[1\]: a GPU block appears twice",
    ),
    "unknown direction": (lambda: _spec("copy"), "direction must be 'store'"),  # type: ignore[arg-type]
    "ragged spec": (
        lambda: TransferSpec("store", [[0], [1]], [[0]], [0, 0]),
        "one entry per group; got 2, 1 and 2",
    ),
    "groups not a sequence": (
        lambda: TransferSpec("store", torch.zeros(2, 1), [[0], [1]], [0, 0]),  # type: ignore[arg-type]
        "gpu_blocks must be a sequence with one entry per group",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SPECS))
async def test_a_bad_spec_raises_before_any_byte_moves(
    device: torch.device, copy: Copy, case: str
) -> None:
    make, pattern = BAD_SPECS[case]
    rig = Rig(device, [[256], [128, 128]], factor=2, num_slots=6, copy=copy)
    before = rig.snapshot()
    with pytest.raises(TransferSpecError, match=pattern):
        await rig.worker.transfer(make())
    with pytest.raises(TransferSpecError, match=pattern):
        rig.worker.submit(make())
    rig.assert_holds(before)
    assert rig.worker.num_in_flight == 0
    assert rig.worker.get_finished() == []


async def test_repeated_sources_are_allowed(device: torch.device, copy: Copy) -> None:
    rig = Rig(device, [[256], [128, 128]], factor=2, num_slots=6, copy=copy)
    await run(rig, _spec("store", gpu=[2, 2, 2]))  # one GPU block stored thrice
    await run(rig, _spec("load", slots=[1, 1]))  # one slot loaded into two places


# -- completion ---------------------------------------------------------------------------
async def test_concurrent_transfers_do_not_block_the_loop_and_return_in_order(
    device: torch.device,
    copy: Copy,
) -> None:
    rig = Rig(device, [[512, 512]], factor=1, num_gpu_blocks=40, num_slots=40, copy=copy)
    before = rig.snapshot()
    specs = [
        TransferSpec("store" if i % 2 == 0 else "load", [[i]], [[39 - i]], [0]) for i in range(40)
    ]
    returned: list[TransferResult] = []
    ticks_while_waiting = 0
    all_done = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks_while_waiting
        while not all_done.is_set():
            ticks_while_waiting += 1
            await anyio.sleep(0)

    async def one(spec: TransferSpec) -> None:
        returned.append(await rig.worker.transfer(spec))

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        async with anyio.create_task_group() as transfers:
            for spec in specs:
                transfers.start_soon(one, spec)
        all_done.set()
    assert ticks_while_waiting > 0
    for direction in ("store", "load"):
        ids = [r.transfer_id for r in returned if r.direction == direction]
        assert ids == sorted(ids) and len(ids) == 20
    expected = before
    for spec in specs:  # disjoint blocks and slots: the order of application is moot
        expected = rig.expected(spec, expected)
    rig.assert_holds(expected)


async def test_results_nobody_takes_are_bounded_and_the_newest_kept(
    device: torch.device, copy: Copy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that orders its work on `done_event` never calls `get_finished`: the
    results it leaves are bounded (oldest dropped, counted), not kept forever."""
    from tierkv.gpu import worker as worker_module

    monkeypatch.setattr(worker_module, "MAX_UNCLAIMED_RESULTS", 3)
    rig = Rig(device, [[256]], factor=1, copy=copy)
    handles = [rig.worker.submit(TransferSpec("store", [[i]], [[i]], [0])) for i in range(5)]
    await rig.worker.drain()
    assert [r.transfer_id for r in rig.worker.get_finished()] == [
        h.transfer_id for h in handles[-3:]
    ]
    assert rig.worker.unclaimed_dropped == 2


async def test_get_finished_hands_out_unawaited_results_once_in_order(
    device: torch.device,
    copy: Copy,
) -> None:
    rig = Rig(device, [[256]], factor=1, copy=copy)
    handles = [rig.worker.submit(TransferSpec("store", [[i]], [[i]], [0])) for i in range(3)]
    awaited = rig.worker.submit(TransferSpec("load", [[9]], [[0]], [0]))
    result = await rig.worker.wait(awaited)
    assert result.transfer_id == awaited.transfer_id and awaited.result is result
    await rig.worker.drain()
    finished = rig.worker.get_finished()
    assert [r.transfer_id for r in finished] == [h.transfer_id for h in handles]
    assert all(r.num_bytes == 256 and r.direction == "store" for r in finished)
    assert rig.worker.get_finished() == []
    await rig.worker.transfer(TransferSpec("store", [[5]], [[5]], [0]))
    assert rig.worker.get_finished() == []  # an awaited result is not handed out twice
    with pytest.raises(RuntimeError, match="already being awaited"):
        await rig.worker.wait(awaited)


class Gate:
    """Stands in for a CUDA event: the copy is done once the test opens the gate.
    Counts how often the worker looks at it."""

    event = None

    def __init__(self) -> None:
        self._open = threading.Event()
        self.queries = 0

    @property
    def open(self) -> bool:
        return self._open.is_set()

    @open.setter
    def open(self, value: bool) -> None:
        assert value, "a gate only opens"
        self._open.set()

    def query(self) -> bool:
        self.queries += 1
        return self._open.is_set()

    def started(self) -> bool:
        return True  # running, until its gate opens

    def wait(self) -> None:
        self._open.wait()

    def seconds(self) -> float:
        return 0.5


def gated(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> list[Gate]:
    """Make every later transfer of `rig` complete only when its gate opens: the
    completion-thread, ordering and hand-out logic of the CUDA path, run on the CPU."""
    gates: list[Gate] = []
    launch = rig.worker._launch

    def launch_gated(mapping: Any, lane: Any) -> Launched:
        launched = launch(mapping, lane)
        gates.append(Gate())
        return Launched(gates[-1], (), launched.backend)

    monkeypatch.setattr(rig.worker, "_launch", launch_gated)
    return gates


async def test_waiters_sleep_until_a_copy_ends_and_return_in_submission_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The completion thread wakes the loop when a copy ends: while nothing ends, the
    worker does not look at the events at all (no polling)."""
    rig = Rig(torch.device("cpu"), [[64]], factor=1)
    gates = gated(rig, monkeypatch)
    returned: list[int] = []
    ticks = 0

    async def one(i: int) -> None:
        result = await rig.worker.transfer(TransferSpec("store", [[i]], [[i]], [0]))
        assert result.seconds == 0.5 and result.num_bytes == 64
        returned.append(i)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        for i in range(5):
            tg.start_soon(one, i)
        await anyio.sleep(0.02)
        assert returned == [] and len(gates) == 5 and rig.worker.num_in_flight == 5
        looks = sum(g.queries for g in gates)
        await anyio.sleep(0.05)
        assert sum(g.queries for g in gates) == looks  # asleep, not polling
        gates[2].open = True  # a later copy cannot finish before an earlier one
        await anyio.sleep(0.02)
        assert returned == []
        gates[0].open = True
        await anyio.sleep(0.02)
        assert returned == [0]
        gates[1].open = True
        await anyio.sleep(0.02)
        assert returned == [0, 1, 2]
        gates[3].open = gates[4].open = True
        await anyio.sleep(0.02)
        assert returned == [0, 1, 2, 3, 4]
        assert ticks >= 10  # the loop kept running all along
        tg.cancel_scope.cancel()
    assert rig.worker.get_finished() == []


async def test_a_late_waiter_does_not_overtake_an_earlier_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both copies are complete when the second wait starts; the first waiter, asleep
    until the completion thread wakes it, still returns first."""
    rig = Rig(torch.device("cpu"), [[64]], factor=1)
    gates = gated(rig, monkeypatch)
    first = rig.worker.submit(TransferSpec("store", [[0]], [[0]], [0]))
    second = rig.worker.submit(TransferSpec("store", [[1]], [[1]], [0]))
    returned: list[int] = []

    async def wait(handle: Any) -> None:
        returned.append((await rig.worker.wait(handle)).transfer_id)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, first)
            await anyio.sleep(0.01)
            gates[0].open = gates[1].open = True
            tg.start_soon(wait, second)
    assert returned == [first.transfer_id, second.transfer_id]


async def test_a_cancelled_wait_leaves_its_result_to_get_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = Rig(torch.device("cpu"), [[64]], factor=1)
    gates = gated(rig, monkeypatch)
    later: list[TransferResult] = []

    async def second() -> None:
        later.append(await rig.worker.transfer(TransferSpec("store", [[1]], [[1]], [0])))

    async with anyio.create_task_group() as tg:
        with anyio.move_on_after(0.02):
            tg.start_soon(second)
            # `wait` may be cancelled (`transfer` may not: see the next test)
            await rig.worker.wait(rig.worker.submit(TransferSpec("store", [[0]], [[0]], [0])))
        gates[0].open = gates[1].open = True
        await anyio.sleep(0.02)
    assert [r.transfer_id for r in later] == [2]  # the next waiter took over
    assert [r.transfer_id for r in rig.worker.get_finished()] == [1]
    assert rig.worker.get_finished() == []


async def test_a_cancelled_transfer_still_waits_for_its_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller frees its slots and GPU blocks when `transfer` returns or raises, so a
    cancelled `transfer` must not return while its queued copy can still touch them."""
    rig = Rig(torch.device("cpu"), [[64]], factor=1)
    gates = gated(rig, monkeypatch)

    async def device_catches_up() -> None:
        await anyio.sleep(0.1)
        gates[0].open = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(device_catches_up)
        with anyio.move_on_after(0.01) as scope:
            await rig.worker.transfer(TransferSpec("store", [[0]], [[0]], [0]))
        assert scope.cancel_called  # the deadline passed while the copy was queued...
        assert gates[0].open and rig.worker.num_in_flight == 0  # ...yet it returned after


async def test_drain_returns_once_nothing_is_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(torch.device("cpu"), [[64]], factor=1)
    gates = gated(rig, monkeypatch)
    rig.worker.submit(TransferSpec("load", [[0]], [[0]], [0]))
    rig.worker.submit(TransferSpec("store", [[0]], [[1]], [0]))
    drained = False

    async def drain() -> None:
        nonlocal drained
        await rig.worker.drain()
        drained = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(drain)
        await anyio.sleep(0.01)
        assert not drained and rig.worker.get_finished() == []
        gates[0].open = True
        await anyio.sleep(0.01)
        assert not drained
        gates[1].open = True
    assert drained
    assert [r.direction for r in rig.worker.get_finished()] == ["load", "store"]


async def test_several_specs_are_one_submission_checked_as_a_whole(
    device: torch.device, copy: Copy
) -> None:
    rig = Rig(device, [[256], [128, 128]], factor=2, num_slots=6, copy=copy)
    first = TransferSpec("store", [[0, 1], []], [[0], []], [0, 0])
    second = TransferSpec("store", [[], [4, 5, 6]], [[], [2, 3]], [0, 1])
    before = rig.snapshot()
    result = await rig.worker.transfer([first, second])
    rig.assert_holds(rig.expected(second, rig.expected(first, before)))
    assert result.num_blocks == 5 and result.num_bytes == 2 * 256 + 3 * 256
    bad = {
        "a slot twice across specs": (
            [first, TransferSpec("store", [[2, 3], []], [[0], []], [0, 0])],
            "a slot appears twice",
        ),
        "a GPU block loaded twice across specs": (
            [
                TransferSpec("load", [[0, 1], []], [[0], []], [0, 0]),
                TransferSpec("load", [[1, 2], []], [[1], []], [0, 0]),
            ],
            r"gpu_blocks\[0\]: a GPU block appears twice",
        ),
        "two directions": (
            [first, TransferSpec("load", [[5], []], [[4], []], [0, 0])],
            "one submission moves one direction",
        ),
        "nothing": ([], "give at least one TransferSpec"),
    }
    before = rig.snapshot()
    for specs, pattern in bad.values():
        with pytest.raises(TransferSpecError, match=pattern):
            rig.worker.submit(specs)
    rig.assert_holds(before)
    assert rig.worker.num_in_flight == 0 and rig.worker.get_finished() == []
