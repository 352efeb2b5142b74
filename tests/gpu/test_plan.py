"""The DMA plan is plain address arithmetic: one (dst, src, size) triple per (GPU block,
layer) page, contiguous runs merged. Proven here on CPU, byte for byte, by applying the
very triples with `memmove` (and with the per-run `copy_` fallback) against a reference
loop written from the documented row layout, for random geometries: several groups,
head and tail trims, factors, dtypes, strided and offset layer views."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.contract.errors import ConfigError
from tierkv.gpu import DIRECTIONS, TransferSpec, TransferWorker
from tierkv.gpu.backends import group_tables
from tierkv.gpu.executors import RunCopies, flat_bytes, memmove
from tierkv.gpu.geometry import Geometry
from tierkv.gpu.mapping import map_specs
from tierkv.gpu.plan import CopyPlan, GroupTable, Planner, SlabTable, build_plan, coalesce
from tierkv.layout import GroupSpec, KVLayout


def test_triples_follow_the_documented_addresses() -> None:
    """One group, layers of 8 and 4 bytes, factor 2 (chunks of 12 bytes): GPU block 3
    of a store at sub-block 1 of slot 5, block 0 at sub-block 0 of slot 6."""
    table = GroupTable.of(
        gpu_base=[1000, 5000], gpu_stride=[16, 4], layer_offset=[0, 8], page=[8, 4]
    )
    geometry = Geometry(((8, 4),), 2, 24, (10,), 8)
    spec = TransferSpec("store", [[3, 0]], [[5, 6]], [1])
    plan = build_plan(map_specs([spec], geometry), [table], SlabTable(100, 12), coalesce_runs=False)
    rows = [5 * 2 + 1, 6 * 2 + 0]
    assert plan.dsts.tolist() == [
        100 + rows[0] * 12 + 0,
        100 + rows[0] * 12 + 8,
        100 + rows[1] * 12 + 0,
        100 + rows[1] * 12 + 8,
    ]
    assert plan.srcs.tolist() == [1000 + 3 * 16, 5000 + 3 * 4, 1000, 5000]
    assert plan.sizes.tolist() == [8, 4, 8, 4]
    load = build_plan(
        map_specs([TransferSpec("load", [[3, 0]], [[5, 6]], [1])], geometry),
        [table],
        SlabTable(100, 12),
        coalesce_runs=False,
    )
    assert (load.dsts.tolist(), load.srcs.tolist()) == (plan.srcs.tolist(), plan.dsts.tolist())


def test_coalescing_merges_only_runs_contiguous_on_both_sides() -> None:
    plan = CopyPlan(
        np.array([0, 8, 16, 100, 108], dtype=np.uint64),
        np.array([50, 58, 70, 200, 208], dtype=np.uint64),
        np.array([8, 8, 8, 8, 8], dtype=np.uint64),
    )
    merged = coalesce(plan)
    assert merged.dsts.tolist() == [0, 16, 100]
    assert merged.srcs.tolist() == [50, 70, 200]
    assert merged.sizes.tolist() == [16, 8, 16]
    assert merged.num_bytes == plan.num_bytes


def test_a_cross_layer_cache_is_one_copy_per_block() -> None:
    """`[blocks, layers, page]`: a block's layers are adjacent on the GPU and in the
    chunk, so each block is one copy of all its layers."""
    cross = torch.arange(10 * 3 * 32, dtype=torch.int32).view(10, 3, 32)
    layers = [cross[:, i] for i in range(3)]
    slab = torch.zeros(4, 3 * 128, dtype=torch.uint8)
    geometry = Geometry(((128, 128, 128),), 1, 384, (10,), 4)
    mapping = map_specs([TransferSpec("store", [[7, 2, 5]], [[3, 0, 1]], [0])], geometry)
    plan = build_plan(mapping, group_tables([layers], geometry), SlabTable(slab.data_ptr(), 384))
    assert plan.count == 3 and plan.sizes.tolist() == [384] * 3
    memmove(plan)
    for block, slot in ((7, 3), (2, 0), (5, 1)):
        assert torch.equal(slab[slot], cross[block].contiguous().view(torch.uint8).flatten())


def test_a_one_block_plan_of_a_cross_layer_cache_is_still_merged() -> None:
    """The planner skips merging a one-block plan only where no two layers can be
    contiguous; a cross-layer cache's block stays one copy."""
    cross = torch.arange(10 * 3 * 32, dtype=torch.int32).view(10, 3, 32)
    geometry = Geometry(((128, 128, 128),), 1, 384, (10,), 4)
    planner = Planner(group_tables([[cross[:, i] for i in range(3)]], geometry), SlabTable(0, 384))
    plan = planner.plan(map_specs([TransferSpec("load", [[6]], [[2]], [0])], geometry))
    assert (plan.count, plan.sizes.tolist()) == (1, [384])


def test_a_planner_reused_across_transfers_gives_what_a_fresh_one_gives() -> None:
    """The planner caches per-geometry facts (page sizes of 1..N blocks, merge
    possibility); plans of many transfers through one planner equal those of a fresh
    planner per transfer, in both directions, for 1 to 70 blocks (past the cache)."""
    rng = np.random.default_rng(3)
    pages = (64, 32, 64)
    geometry = Geometry((pages,), 1, sum(pages), (100,), 100)
    table = GroupTable.of(
        gpu_base=[1 << 30, 2 << 30, 3 << 30], gpu_stride=pages, layer_offset=[0, 64, 96], page=pages
    )
    slab = SlabTable(1 << 20, sum(pages))
    kept = Planner([table], slab)
    for n in (1, 2, 1, 5, 70, 70, 1):
        for direction in DIRECTIONS:
            spec = TransferSpec(
                direction, [rng.permutation(100)[:n]], [rng.permutation(100)[:n]], [0]
            )
            mapping = map_specs([spec], geometry)
            got, want = kept.plan(mapping), build_plan(mapping, [table], slab)
            assert [a.tolist() for a in (got.dsts, got.srcs, got.sizes)] == [
                a.tolist() for a in (want.dsts, want.srcs, want.sizes)
            ]
            assert got.count == 3 * n and got.num_bytes == n * sum(pages)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1).clone()


def _reference(
    kv: list[list[torch.Tensor]], slab: torch.Tensor, geometry: Geometry, spec: TransferSpec
) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """What KV (`[blocks, page]` bytes per layer) and slab hold after `spec`, page by
    page, from the documented row layout."""
    out_kv = [[t.clone() for t in g] for g in kv]
    out_slab = slab.clone()
    factor, stride = geometry.block_size_factor, geometry.sub_block_stride
    for g, pages in enumerate(geometry.page_bytes):
        head = int(spec.block_indices[g]) % factor  # type: ignore[call-overload]
        slots = [int(s) for s in spec.slots[g]]
        for k, block in enumerate(int(b) for b in spec.gpu_blocks[g]):
            slot, sub = slots[(head + k) // factor], (head + k) % factor
            offset = sub * stride
            for layer, page in enumerate(pages):
                if spec.direction == "store":
                    out_slab[slot, offset : offset + page] = kv[g][layer][block]
                else:
                    out_kv[g][layer][block] = slab[slot, offset : offset + page]
                offset += page
    return out_kv, out_slab


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, object]:
    factor = draw(st.integers(1, 3))
    groups = draw(
        st.lists(
            st.lists(st.sampled_from([2, 6, 16, 48, 64]), min_size=1, max_size=3),
            min_size=1,
            max_size=3,
        )
    )
    blocks = [draw(st.integers(1, 8)) for _ in groups]
    num_slots = draw(st.integers(1, 6))
    direction = draw(st.sampled_from(["store", "load"]))
    specs = []
    free = list(range(num_slots))
    used_gpu: list[set[int]] = [set() for _ in groups]
    for _ in range(draw(st.integers(1, 3))):  # several specs: one submission
        gpu, slots, indices = [], [], []
        for g in range(len(groups)):
            head = draw(st.integers(0, factor - 1))
            pool = [b for b in range(blocks[g]) if direction == "store" or b not in used_gpu[g]]
            most = min(len(pool), len(free) * factor - head)
            n = draw(st.integers(0, max(most, 0)))
            ids = draw(st.permutations(pool))[:n] if n else []
            used_gpu[g].update(ids)
            spans = -(-(head + n) // factor) if n else 0
            chosen = draw(st.permutations(free))[:spans] if spans else []
            if direction == "store":
                free = [s for s in free if s not in chosen]
            gpu.append(ids)
            slots.append(chosen)
            indices.append(head + factor * draw(st.integers(0, 3)))
        specs.append(TransferSpec(direction, gpu, slots, indices))  # type: ignore[arg-type]
    return {
        "factor": factor,
        "groups": groups,
        "blocks": blocks,
        "num_slots": num_slots,
        "specs": specs,
        "strided": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _layers(
    pages: list[int], blocks: int, strided: bool, gen: torch.Generator
) -> list[torch.Tensor]:
    """Per-layer tensors; `strided`: views into one buffer, at offsets, blocks apart."""
    if not strided:
        dtypes = (torch.uint8, torch.int16, torch.float32)
        out = []
        for i, page in enumerate(pages):
            dtype = dtypes[i % 3]
            size = torch.empty(0, dtype=dtype).element_size()
            raw = torch.randint(0, 256, (blocks, page), dtype=torch.uint8, generator=gen)
            out.append(raw.view(dtype) if page % size == 0 else raw)
        return out
    width = sum(pages) + 8
    buffer = torch.randint(0, 256, (blocks, width), dtype=torch.uint8, generator=gen)
    offsets = np.cumsum([4, *pages[:-1]]).tolist()
    return [buffer[:, o : o + p] for o, p in zip(offsets, pages)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases(), executor=st.sampled_from(["memmove", "runs", "unmerged"]))
def test_random_plans_move_exactly_the_reference_bytes(case: dict, executor: str) -> None:  # type: ignore[type-arg]
    gen = torch.Generator().manual_seed(case["seed"])
    kv = [_layers(p, b, case["strided"], gen) for p, b in zip(case["groups"], case["blocks"])]
    factor = case["factor"]
    block_bytes = factor * max(sum(p) for p in case["groups"])
    slab = torch.randint(0, 256, (case["num_slots"], block_bytes), dtype=torch.uint8, generator=gen)
    geometry = Geometry(
        tuple(tuple(p) for p in case["groups"]),
        factor,
        block_bytes,
        tuple(case["blocks"]),
        case["num_slots"],
    )
    specs = case["specs"]
    mapping = map_specs(specs, geometry)
    plan = build_plan(
        mapping,
        group_tables(kv, geometry),
        SlabTable(slab.data_ptr(), geometry.sub_block_stride),
        coalesce_runs=executor != "unmerged",
    )
    assert plan.num_bytes == mapping.num_bytes
    order = np.argsort(plan.dsts)  # destinations never overlap: copies may run in any order
    assert (plan.dsts[order][1:] >= plan.dsts[order][:-1] + plan.sizes[order][:-1]).all()
    want_kv = [[_as_bytes(t) for t in g] for g in kv]
    want_slab = slab.clone()
    for spec in specs:  # the specs of one submission touch disjoint destinations
        want_kv, want_slab = _reference(want_kv, want_slab, geometry, spec)
    if executor == "runs":
        RunCopies([flat_bytes(t) for g in kv for t in g] + [flat_bytes(slab)])(plan)
    else:
        memmove(plan)
    assert torch.equal(slab, want_slab)
    for g, layers in enumerate(kv):
        for layer, t in enumerate(layers):
            assert torch.equal(_as_bytes(t), want_kv[g][layer]), (g, layer)


def test_backend_and_executor_choices_are_checked() -> None:
    kv = [[torch.zeros(4, 64, dtype=torch.uint8)]]
    slab = torch.zeros(2, 64, dtype=torch.uint8)
    layout = KVLayout(block_bytes=64, groups=(GroupSpec(block_size=4),))
    with pytest.raises(
        ConfigError, match="copy_backend: 'copy' is not one of auto, dma, bounded, kernel"
    ):
        TransferWorker(kv, slab, layout, gpu_block_size=4, copy_backend="copy")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs cuda-bindings"):
        TransferWorker(
            kv, slab, layout, gpu_block_size=4, copy_backend="dma", dma_executor="batched"
        )
    with pytest.raises(ConfigError, match="dma_executor: 'fast' is not one of"):
        TransferWorker(kv, slab, layout, gpu_block_size=4, dma_executor="fast")  # type: ignore[arg-type]
    auto = TransferWorker(kv, slab, layout, gpu_block_size=4)
    assert auto.dma_executor is None  # the CPU device has no copy engines: kernels
    dma = TransferWorker(kv, slab, layout, gpu_block_size=4, copy_backend="dma")
    assert dma.dma_executor == "memmove"


class _Stream:
    cuda_stream = 1234


@pytest.mark.parametrize("fail", [False, True])
def test_the_batched_executor_gets_the_plan_and_redoes_a_refused_call_by_runs(
    fail: bool,
) -> None:
    """Through the real `BatchMemcpy` over a fake driver function (host memmove): a
    refused call's copies are redone by runs, and the executor stays batched, so the
    next transfer is batched again (one failure used to disable it for good)."""
    from tests.gpu.test_cuda_batch import FakeDriver
    from tierkv.gpu.backends import DmaCopy
    from tierkv.gpu.cuda_batch import ABI_13_0, BatchMemcpy

    kv = [[torch.arange(6 * 32, dtype=torch.uint8).view(6, 32) for _ in range(2)]]
    slab = torch.zeros(3, 64, dtype=torch.uint8)
    geometry = Geometry(((32, 32),), 1, 64, (6,), 3)
    driver = FakeDriver(ABI_13_0, fail_calls={0} if fail else set())
    batch = BatchMemcpy(driver.function(), ABI_13_0)
    dma = DmaCopy(kv, slab, geometry, executor="batched", batch=batch)
    mapping = map_specs([TransferSpec("store", [[4]], [[2]], [0])], geometry)
    dma.enqueue(mapping, _Stream(), None)
    assert [(c["count"], c["stream"]) for c in driver.calls] == [(2, 1234)]  # every page
    assert torch.equal(slab[2], torch.cat([kv[0][0][4], kv[0][1][4]]))
    assert dma.executor == "batched" and batch.stats.failed_calls == int(fail)
    mapping = map_specs([TransferSpec("store", [[5]], [[1]], [0])], geometry)
    dma.enqueue(mapping, _Stream(), None)
    assert len(driver.calls) == 2  # batched again
    assert torch.equal(slab[1], torch.cat([kv[0][0][5], kv[0][1][5]]))


@pytest.mark.parametrize("bad", [0, -3, True])
def test_a_bad_max_copies_per_call_is_refused(bad: object) -> None:
    kv = [[torch.zeros(6, 32, dtype=torch.uint8) for _ in range(2)]]
    slab = torch.zeros(3, 64, dtype=torch.uint8)
    layout = KVLayout(block_bytes=64, groups=(GroupSpec(block_size=4),))
    with pytest.raises(ConfigError, match="max_copies_per_call"):
        TransferWorker(kv, slab, layout, gpu_block_size=4, max_copies_per_call=bad)  # type: ignore[arg-type]


def test_a_device_view_that_is_a_copy_is_refused_and_a_true_alias_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel backend's alias check writes through the view and reads the host
    byte: a helper that silently copies the slab (reads look right) is refused."""
    from tierkv.gpu import alias as alias_module

    monkeypatch.setattr(alias_module, "require_pinned", lambda slab: None)  # CPU: no pinning
    slab = torch.arange(2 * 64, dtype=torch.uint8).view(2, 64)
    original = slab.clone()
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="is a copy, not an alias"):
        alias_module.device_alias(slab, cpu, lambda pinned, device: pinned.clone().view(-1))
    assert torch.equal(slab, original)
    view = alias_module.device_alias(slab, cpu, lambda pinned, device: pinned.view(-1))
    assert view.data_ptr() == slab.data_ptr()
    assert torch.equal(slab, original)  # the probe left no trace
