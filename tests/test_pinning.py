"""`tierkv.pinning`: the slab pinned at exactly its size, registered in chunks of whole
blocks. On CPU a fake `cudart` records what would be registered."""

from __future__ import annotations

import gc
import mmap
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tierkv import pinning
from tierkv.pinning import HostMemory, registration_chunks


@given(
    num_blocks=st.integers(1, 5000),
    block_bytes=st.integers(1, 1 << 22),
    max_bytes=st.integers(1, 1 << 24),
)
def test_chunks_are_whole_blocks_that_cover_the_slab_once(
    num_blocks: int, block_bytes: int, max_bytes: int
) -> None:
    chunks = registration_chunks(num_blocks, block_bytes, max_bytes)
    position = 0
    for offset, length in chunks:
        assert offset == position  # in order, no gap, no overlap
        assert length % block_bytes == 0 and length > 0  # whole blocks: no copy spans two
        assert length <= max(max_bytes, block_bytes)
        position += length
    assert position == num_blocks * block_bytes


class FakeCudart:
    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, length: int, flags: int) -> int:
        assert flags == 0
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((address, length))
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        assert is_mapped(address), "unregistered after the memory was unmapped"
        self.unregistered.append(address)
        return 0


def is_mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            if low <= address < high:
                return True
    return False


def test_an_unpinned_slab_is_exactly_its_size_and_page_aligned() -> None:
    memory = HostMemory(10, 4096 + 3, pin=False)
    assert tuple(memory.tensor.shape) == (10, 4099)
    assert memory.tensor.data_ptr() % mmap.PAGESIZE == 0
    assert memory.pinned_bytes == 0
    memory.tensor[9, -1] = 7  # writable to the last byte
    memory.close()


def test_a_pinned_slab_registers_exactly_its_bytes_and_unregisters_at_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(pinning, "MAX_REGISTRATION_BYTES", 3 * 1000)
    memory = HostMemory(10, 1000, pin=True)
    base = memory.tensor.data_ptr()
    assert fake.registered == [
        (base, 3000),
        (base + 3000, 3000),
        (base + 6000, 3000),
        (base + 9000, 1000),
    ]
    assert memory.pinned_bytes == 10 * 1000  # not the next power of two
    memory.close()
    assert fake.unregistered == [a for a, _ in reversed(fake.registered)]
    memory.close()  # idempotent
    assert len(fake.unregistered) == 4


def test_a_refused_registration_undoes_the_rest_and_falls_back_to_torch_pinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCudart(fail_at=1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(pinning, "MAX_REGISTRATION_BYTES", 1000)
    made: list[dict[str, Any]] = []
    real_empty_like = torch.empty_like

    def empty_like(t: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        made.append(kwargs)
        return real_empty_like(t)  # CPU torch cannot pin: stand in for it

    monkeypatch.setattr(torch, "empty_like", empty_like)
    memory = HostMemory(3, 1000, pin=True)
    assert fake.unregistered == [fake.registered[0][0]]  # the one that succeeded
    assert made == [{"pin_memory": True}]
    assert tuple(memory.tensor.shape) == (3, 1000)


def test_the_last_reference_going_unregisters_before_the_memory_is_unmapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without `close`: a range unmapped while registered stays registered in the
    driver, and a later slab mapped at the same address could not be registered."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(pinning, "MAX_REGISTRATION_BYTES", 2 * 4096)
    memory = HostMemory(4, 4096, pin=True)
    tensor, base = memory.tensor, memory.tensor.data_ptr()
    del memory
    gc.collect()
    assert fake.unregistered == []  # the tensor still uses it
    tensor[3, -1] = 9  # and it is still mapped
    del tensor
    gc.collect()
    assert fake.unregistered == [base + 2 * 4096, base]  # the fake checked: still mapped
    assert not is_mapped(base)  # then unmapped


def test_close_then_the_last_reference_unregisters_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    memory = HostMemory(4, 4096, pin=True)
    assert memory.registered
    memory.close()
    assert len(fake.unregistered) == 1 and not memory.registered
    del memory
    gc.collect()
    assert len(fake.unregistered) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_slab_is_pinned_by_registration_at_its_size_not_by_torch() -> None:
    """1.5 GiB: torch's caching host allocator would round it up to 2 GiB."""
    for _ in range(3):  # each slab dropped without close: the next maps the same range
        memory = HostMemory(3 * 256, 2 << 20, pin=True)
        assert memory.registered and memory.tensor.is_pinned()
        assert memory.pinned_bytes == 3 << 29
        memory.tensor[-1].fill_(0xA5)
        on_gpu = memory.tensor[-1].to("cuda", non_blocking=True)
        memory.tensor[0].copy_(on_gpu, non_blocking=True)
        torch.cuda.synchronize()
        assert bool((memory.tensor[0] == 0xA5).all())
        del memory, on_gpu
        gc.collect()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_refused_registration_does_not_fail_the_next_kernel() -> None:
    memory = HostMemory(2, 4096, pin=True)
    try:
        with pytest.raises(RuntimeError, match="cudaHostRegister returned CUDA error"):
            pinning.register(memory.tensor.data_ptr(), 4096)  # registered already
        x = torch.ones(8, device="cuda") + 1  # torch checks the last error here
        torch.cuda.synchronize()
        assert x.sum().item() == 16
    finally:
        memory.close()
