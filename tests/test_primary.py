"""The primary tier's block life cycle, as concrete capacity-4 scenarios.

Keys are one letter (b"A", b"B", ...) for readability; the primary treats keys as
opaque bytes.
"""

from __future__ import annotations

import pytest
import torch

from tierkv.contract.errors import BlockStateError, ConfigError
from tierkv.contract.events import OffloadingEvent
from tierkv.layout import KVLayout
from tierkv.primary import HostSlab, PrimaryConfig, PrimaryTier

A, B, C, D, E, F = (bytes([c]) for c in b"ABCDEF")


def make(eviction: str = "lru", blocks: int = 4, block_bytes: int = 8) -> PrimaryTier:
    return PrimaryTier(blocks, block_bytes, eviction=eviction, pin_memory=False)


def store(p: PrimaryTier, *keys: bytes) -> list[int]:
    out = p.prepare_store(list(keys))
    assert out is not None
    p.complete_store(out.keys_to_store)
    return out.slots


# -- the slab --------------------------------------------------------------------
def test_slab_is_one_uint8_tensor_and_blocks_are_zero_copy_views() -> None:
    p = make(blocks=4, block_bytes=8)
    assert p.view.tensor.shape == (4, 8) and p.view.tensor.dtype == torch.uint8
    view = p.view.block(2)
    assert not view.readonly and len(view) == 8
    view[:] = b"abcdefgh"
    assert bytes(p.view.tensor[2].numpy()) == b"abcdefgh"
    p.view.tensor[1].fill_(7)
    assert bytes(p.view.block(1)) == b"\x07" * 8


@pytest.mark.parametrize("slot", [-1, 4, 1.0, True])
def test_block_out_of_range_raises(slot: object) -> None:
    with pytest.raises(IndexError, match=r"out of range 0\.\.3"):
        make().view.block(slot)  # type: ignore[arg-type]


def test_pin_memory_auto_pins_only_with_cuda() -> None:
    assert make().pinned is False
    p = PrimaryTier(2, 8, pin_memory="auto")
    assert p.pinned == torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_pin_memory_true_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="pin_memory: true needs CUDA"):
        PrimaryTier(2, 8, pin_memory=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pin_memory_true_pins_with_cuda() -> None:
    p = PrimaryTier(2, 8, pin_memory=True)
    assert p.view.tensor.is_pinned()


def test_from_config_sizes_the_slab() -> None:
    layout = KVLayout(block_bytes=1024, groups=[{"block_size": 16}])  # type: ignore[list-item]
    p = PrimaryTier.from_config(PrimaryConfig(capacity="10KiB", pin_memory=False), layout, "ns")  # type: ignore[arg-type]
    assert p.num_blocks == 10 and p.view.block_bytes == 1024 and p.view.namespace == "ns"
    with pytest.raises(ConfigError, match="holds no block of 1KiB"):
        PrimaryTier.from_config(PrimaryConfig(capacity=512), layout, "ns")  # type: ignore[arg-type]


def test_view_rejects_a_wrong_slab() -> None:
    with pytest.raises(ValueError, match="contiguous 2-D uint8"):
        HostSlab(torch.zeros(4, 8, dtype=torch.float32), "ns")


# -- store life cycle --------------------------------------------------------------
def test_store_allocates_slots_in_order_and_becomes_ready_on_completion() -> None:
    p = make()
    out = p.prepare_store([A, B])
    assert out is not None
    assert out == ([A, B], [0, 1], [])
    assert p.lookup([A, B]) == 0  # being written: not readable
    assert p.num_evictable == 0
    p.complete_store([A, B])
    assert p.lookup([A, B, C]) == 2
    assert p.num_evictable == 2
    assert p.take_events() == [OffloadingEvent((A, B), "cpu", removed=False)]
    assert p.take_events() == []


def test_prepare_store_skips_resident_and_duplicate_keys() -> None:
    p = make()
    store(p, A)
    out = p.prepare_store([A, B, B, C])
    assert out is not None and out.keys_to_store == [B, C] and out.slots == [1, 2]


def test_failed_store_frees_only_slots_still_being_written() -> None:
    p = make()
    store(p, A)
    out = p.prepare_store([A, B, C])
    assert out is not None and out.slots == [1, 2]
    p.complete_store([A, B, C], success=False)
    assert p.lookup([A]) == 1  # A was ready: untouched
    assert B not in p and C not in p
    assert p.num_free == 3
    assert p.take_events() == [OffloadingEvent((A,), "cpu", removed=False)]
    # the freed slots are reused
    out = p.prepare_store([D])
    assert out is not None and out.slots[0] in (1, 2)


def test_an_event_sink_gets_every_event_as_it_happens_kept_ones_first() -> None:
    p = make("lru", blocks=2)
    store(p, A)  # kept for take_events: no sink yet
    got: list[OffloadingEvent] = []
    p.set_event_sink(got.append)
    assert got == [OffloadingEvent((A,), "cpu", removed=False)]  # handed over, in order
    store(p, B)
    out = p.prepare_store([C])  # evicts A: told before C's slot is even written
    assert out is not None
    assert got[1:] == [
        OffloadingEvent((B,), "cpu", removed=False),
        OffloadingEvent((A,), "cpu", removed=True),
    ]
    p.complete_store([C])
    assert got[-1] == OffloadingEvent((C,), "cpu", removed=False)
    assert p.take_events() == []  # the sink took them all
    p.set_event_sink(None)
    store(p, D)
    assert len(got) == 4 and [e.removed for e in p.take_events()] == [True, False]


def test_lookup_counts_the_ready_prefix_only() -> None:
    p = make()
    store(p, A, B)
    p.prepare_store([C])
    store(p, D)
    assert p.lookup([A, B, C, D]) == 2  # C is being written
    assert p.lookup([B, A]) == 2
    assert p.lookup([E, A]) == 0
    assert p.lookup([]) == 0


# -- eviction ------------------------------------------------------------------------
def test_lru_evicts_oldest_ready_block_and_reuses_its_slot() -> None:
    p = make("lru")
    assert store(p, A, B, C, D) == [0, 1, 2, 3]
    p.take_events()
    out = p.prepare_store([E])
    assert out == ([E], [0], [A])
    assert p.take_events() == [OffloadingEvent((A,), "cpu", removed=True)]
    p.complete_store([E])
    out = p.prepare_store([F])
    assert out is not None and out.evicted_keys == [B] and out.slots == [1]


def test_touch_makes_the_first_key_most_recent() -> None:
    p = make("lru")
    store(p, A, B, C, D)
    p.touch([B, A])  # order now C, D, A, B (B most recent)
    assert p.policy.eviction_order() == [C, D, A, B]
    out = p.prepare_store([E, F])
    assert out is not None and out.evicted_keys == [C, D]


def test_blocks_being_written_or_read_are_not_evictable() -> None:
    p = make("lru")
    store(p, A, B)
    p.prepare_store([C])  # C writing
    store(p, D)
    assert p.prepare_load([A]) == [0]  # A has a reader
    assert p.num_evictable == 2  # B and D
    out = p.prepare_store([E])
    assert out is not None and out.evicted_keys == [B]
    p.complete_store([E])
    out = p.prepare_store([F])
    assert out is not None and out.evicted_keys == [D]


def test_impossible_store_returns_none_and_changes_nothing() -> None:
    p = make("lru")
    store(p, A, B, C)
    p.prepare_load([A])
    p.prepare_store([D])  # writing
    before = (p.num_free, p.num_evictable, p.policy.eviction_order(), p.take_events())
    assert p.prepare_store([E, F, b"G"]) is None  # needs 3, only B and C evictable
    assert (p.num_free, p.num_evictable, p.policy.eviction_order(), p.take_events()) == (
        before[0],
        before[1],
        before[2],
        [],
    )
    assert p.lookup([A, B, C]) == 3


def test_keys_passed_to_prepare_store_are_never_evicted_by_that_call() -> None:
    p = make("lru")
    store(p, A, B, C, D)
    out = p.prepare_store([A, E])  # A is the LRU victim, but it is part of this store
    assert out is not None and out.evicted_keys == [B] and out.keys_to_store == [E]
    assert A in p
    # when only the protected keys are evictable, the store is refused
    p.complete_store([E])
    for key in (C, D, E):
        p.prepare_load([key])
    assert p.prepare_store([A, F]) is None
    assert A in p and p.num_evictable == 1


def test_reader_release_makes_a_block_evictable_again() -> None:
    p = make("lru", blocks=1)
    store(p, A)
    p.prepare_load([A])
    p.prepare_load([A])
    assert p.readers(A) == 2
    assert p.prepare_store([B]) is None
    p.complete_load([A])
    assert p.prepare_store([B]) is None  # one reader left
    p.complete_load([A])
    assert p.num_evictable == 1
    out = p.prepare_store([B])
    assert out is not None and out.evicted_keys == [A]


# -- load life cycle -----------------------------------------------------------------
def test_prepare_load_returns_slots_in_key_order() -> None:
    p = make()
    store(p, A, B, C)
    assert p.prepare_load([C, A]) == [2, 0]


def test_loading_a_block_being_written_or_absent_fails_and_changes_nothing() -> None:
    p = make()
    store(p, A)
    p.prepare_store([B])
    with pytest.raises(BlockStateError, match="still being written"):
        p.prepare_load([A, B])
    with pytest.raises(BlockStateError, match="not in the primary tier"):
        p.prepare_load([A, C])
    assert p.readers(A) == 0 and p.num_evictable == 1


def test_complete_load_without_prepare_fails_and_changes_nothing() -> None:
    p = make()
    store(p, A, B)
    p.prepare_load([A])
    with pytest.raises(BlockStateError, match="without a matching prepare_load"):
        p.complete_load([A, B])
    with pytest.raises(BlockStateError):
        p.complete_load([A, A])
    assert p.readers(A) == 1


def test_arc_primary_evicts_from_t1_before_t2() -> None:
    p = make("arc")
    store(p, A, B, C, D)
    p.touch([A, B])  # A, B seen again -> T2
    out = p.prepare_store([E])
    assert out is not None and out.evicted_keys == [C]  # oldest of T1


def test_prepare_store_prefix_reserves_the_longest_prefix_that_fits() -> None:
    p = make("lru")
    store(p, A, B)
    p.prepare_load([A])  # A held: not a victim
    out = p.prepare_store_prefix([C, D, E, F])
    assert out.keys_to_store == [C, D, E] and out.evicted_keys == [B]
    p.complete_store(out.keys_to_store)
    assert p.prepare_store_prefix([F]).keys_to_store == [F]  # evicts C (oldest unheld)
    p.complete_store([F])
    vetoed = p.prepare_store_prefix([b"G"], may_evict=lambda k: False)
    assert vetoed.keys_to_store == [] and len(p) == 4  # nothing changed


def test_may_evict_vetoes_victims_without_changing_anything() -> None:
    p = make("lru")
    store(p, A, B, C, D)
    assert p.prepare_store([E], may_evict=lambda k: k not in (A, B, C, D)) is None
    assert len(p) == 4 and p.num_evictable == 4
    out = p.prepare_store([E], may_evict=lambda k: k != A)
    assert out is not None and out.evicted_keys == [B]
    assert p.candidates(2) == [A, C]  # the veto was for that call only
