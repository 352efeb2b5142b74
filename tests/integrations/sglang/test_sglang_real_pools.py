"""The backend over SGLang's OWN host pools (`MHATokenToKVPoolHost`,
`MLATokenToKVPoolHost`, built on CPU over SGLang's device pools: `real_pools.py` says
how), and the stand-in the other tests use checked against them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tierkv.integrations.sglang.stand_in import HostPoolStandIn

PAGE = 16
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning"  # SGLang's own, on import
)


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def page_bytes(pool: Any, page: int) -> bytes:
    """The page as SGLang's own `get_data_page` reads it."""
    return bytes(pool.get_data_page(page * PAGE).contiguous().view(torch.uint8).numpy())


def build(real_pools: Any, mla: bool, layout: str) -> Any:
    if mla:
        return real_pools.mla_host_pool(pages=8, page_size=PAGE, layout=layout)
    return real_pools.mha_host_pool(pages=8, page_size=PAGE, layout=layout)


CASES = [(False, "page_first"), (False, "layer_first"), (False, "page_first_direct"),
         (True, "page_first"), (True, "layer_first")]


@pytest.mark.parametrize(("mla", "layout"), CASES)
def test_round_trip_over_sglang_host_pools(
    rig: Any, real_pools: Any, mla: bool, layout: str
) -> None:
    hashes = rig.page_hashes(4, "real")
    first = build(real_pools, mla, layout)
    rig.fill(first, [0, 1, 2, 3], f"real-{layout}")  # through SGLang's set_from_flat_data_page
    writer = rig.backend(first, [rig.nvme(layout="files")], mla=mla)
    # a page of several regions is one block of them all (one file), in every layout:
    # K and V one half-buffer apart (MHA page_first), K and V of each layer (MHA
    # layer_first: 4 regions here), one region per layer (MLA layer_first); an MLA
    # page_first page is one region anyway
    assert writer.kv.whole == ((mla, layout) != (True, "page_first"))
    assert writer.kv.key_parts == 1
    assert writer.batch_set_v1(hashes, indices([0, 1, 2, 3])) == [True] * 4
    assert len([p for p in rig.tmp_path.joinpath("nvme").rglob("*.blk")]) == 4
    writer.close()
    second = build(real_pools, mla, layout)
    reader = rig.backend(second, [rig.nvme(layout="files")], mla=mla)
    assert reader.batch_exists(hashes) == 4
    assert reader.batch_get_v1(hashes, indices([7, 6, 5, 4])) == [True] * 4
    for i in range(4):
        assert page_bytes(second, 7 - i) == page_bytes(first, i)


@pytest.mark.parametrize(("mla", "layout"), CASES)
def test_the_stand_in_lays_pages_out_as_sglang(real_pools: Any, mla: bool, layout: str) -> None:
    """Same regions, same offsets in the buffer, same sizes, same buffer shape."""
    real = build(real_pools, mla, layout)
    stand_in = HostPoolStandIn(
        pages=real.size // PAGE, page_size=PAGE, layer_num=2, head_num=2,
        head_dim=96 if mla else 64, layout=layout, mla=mla,
    )
    assert tuple(stand_in.kv_buffer.shape) == tuple(real.kv_buffer.shape)
    for pages in ([0], [3, 1], [real.size // PAGE - 1]):
        theirs, their_sizes = real.get_page_buffer_meta(indices(pages))
        ours, our_sizes = stand_in.get_page_buffer_meta(indices(pages))
        base_real, base_ours = real.kv_buffer.data_ptr(), stand_in.kv_buffer.data_ptr()
        assert [p - base_ours for p in ours] == [p - base_real for p in theirs]
        assert our_sizes == their_sizes


def test_mamba_state_over_sglang_mamba_pool(rig: Any, real_pools: Any) -> None:
    """A hybrid model's state pool: SGLang's own `MambaPoolHost` (three buffers, three
    region sizes) round trips through the v2 calls, and the stand-in lays its slots out
    the same."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from tierkv.integrations.sglang.stand_in import MambaPoolStandIn

    mamba = real_pools.mamba_host_pool(slots=8)
    backend = rig.backend(rig.pool(pages=4), [rig.nvme(layout="files")])
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    buffers = [mamba.temporal_buffer, *mamba.conv_buffer]
    for buffer in buffers:
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))

    def slot_bytes(slot: int) -> bytes:
        return b"".join(bytes(b[slot].contiguous().view(torch.uint8).numpy()) for b in buffers)

    hashes = rig.page_hashes(3, "state")
    put = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0, 1, 2]), keys=hashes)
    assert backend.batch_set_v2([put]) == {"mamba": [True] * 3}
    # three buffers, three region sizes: one block (one nvme file) a slot
    assert backend.sidecars["mamba"].key_parts == 1
    mamba_files = [p for p in rig.tmp_path.joinpath("nvme").rglob("*.blk")
                   if p.stat().st_size == 64 + backend.sidecars["mamba"].page_bytes]
    assert len(mamba_files) == 3
    get = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([7, 6, 5]), keys=hashes)
    assert backend.batch_get_v2([get]) == {"mamba": [True] * 3}
    assert [slot_bytes(7 - i) for i in range(3)] == [slot_bytes(i) for i in range(3)]

    stand_in = MambaPoolStandIn(slots=mamba.size)
    theirs, their_sizes = mamba.get_page_buffer_meta(torch.tensor([0, 5]))
    ours, our_sizes = stand_in.get_page_buffer_meta(torch.tensor([0, 5]))
    assert our_sizes == their_sizes
    bases_real = [b.data_ptr() for b in buffers] * 2
    bases_ours = [b.data_ptr() for b in [stand_in.temporal_buffer, *stand_in.conv_buffer]] * 2
    assert [p - b for p, b in zip(ours, bases_ours)] == [p - b for p, b in zip(theirs, bases_real)]
