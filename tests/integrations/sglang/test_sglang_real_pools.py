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
    writer = rig.backend(first, [rig.nvme()], mla=mla)
    assert writer.batch_set_v1(hashes, indices([0, 1, 2, 3])) == [True] * 4
    writer.close()
    second = build(real_pools, mla, layout)
    reader = rig.backend(second, [rig.nvme()], mla=mla)
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
