"""The bounded copy backend: which backends a worker builds, the options' checks, and
the Triton kernel's addressing proven on CPU under Triton's interpreter (the grid
smaller and larger than the pages to move, pages longer than one step of the kernel,
odd page sizes that force narrow words). The worker-level byte tests of every backend,
this one included, are in test_worker.py; on a GPU they run compiled (`-m cuda`)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.gpu.test_worker import Rig, need_triton, run
from tierkv.contract.errors import ConfigError
from tierkv.gpu import TransferSpec, TransferWorker
from tierkv.gpu.options import choose_backends
from tierkv.gpu.triton_pages import CHUNK
from tierkv.layout import GroupSpec, KVLayout

pytestmark = pytest.mark.anyio

SMALL, LARGE = 16 << 10, 64 << 10


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("copy_backend", "cuda", "pages", "triton", "want"),
    [
        ("auto", False, [SMALL], True, ("kernel", False)),  # CPU: no copy engines
        # with Triton, the bounded kernel whatever the pages: it replays small transfers
        ("auto", True, [LARGE, LARGE], True, ("bounded", True)),
        ("auto", True, [LARGE, SMALL], True, ("bounded", True)),
        ("auto", True, [SMALL], False, ("kernel", True)),  # no Triton: the full kernel
        ("auto", True, [LARGE, LARGE], False, (None, True)),  # ... only where a page is small
        ("dma", True, [SMALL], True, (None, True)),
        ("bounded", True, [LARGE], True, ("bounded", False)),
        ("kernel", False, [LARGE], True, ("kernel", False)),
    ],
)
def test_auto_builds_dma_and_a_kernel_for_what_dma_moves_badly(
    copy_backend: str, cuda: bool, pages: list[int], triton: bool, want: tuple[str | None, bool]
) -> None:
    assert choose_backends(copy_backend, cuda, pages, triton) == want  # type: ignore[arg-type]


def _worker(**options: object) -> TransferWorker:
    kv = [[torch.zeros(4, 64, dtype=torch.uint8)]]
    layout = KVLayout(block_bytes=64, groups=(GroupSpec(block_size=4),))
    return TransferWorker(
        kv, torch.zeros(2, 64, dtype=torch.uint8), layout, gpu_block_size=4, **options
    )  # type: ignore[arg-type]


def test_bounded_without_triton_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "tierkv.gpu.options.triton_missing", lambda: "Triton is not installed (pip install triton)"
    )
    with pytest.raises(ConfigError, match="'bounded' cannot run here: Triton is not installed"):
        _worker(copy_backend="bounded")
    assert _worker(copy_backend="auto").copy_backend == "auto"  # auto still works


def test_the_bounded_backend_keeps_the_kv_caches_it_addresses_alive() -> None:
    """The bounded kernel reaches the KV caches by raw address: a caller that drops its
    own references (an engine rebuilding its caches, a benchmark's helper returning)
    must not leave the worker writing into freed memory. Found by a benchmark whose
    bounded-only worker outlived its KV tensors: its next direct launch segfaulted.
    (The DMA and kernel backends hold views of the same tensors.)"""
    need_triton()
    kv = [[torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 32, dtype=torch.uint8)]]
    slab = torch.zeros(2, 96, dtype=torch.uint8)
    refs = [weakref.ref(t) for t in (*kv[0], slab)]
    layout = KVLayout(block_bytes=96, groups=(GroupSpec(block_size=4),))
    worker = TransferWorker(kv, slab, layout, gpu_block_size=4, copy_backend="bounded")
    del kv, slab
    gc.collect()
    assert all(ref() is not None for ref in refs), "freed while the worker lives"
    refs[2]()[1].fill_(3)  # type: ignore[index]
    worker.submit(TransferSpec("load", [[2]], [[1]], [0]))
    assert refs[0]()[2].tolist() == [3] * 64 and refs[1]()[2].tolist() == [3] * 32  # type: ignore[index]


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_bounded_programs_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"bounded_programs: .* must be a positive int"):
        _worker(bounded_programs=bad)


@pytest.mark.parametrize("programs", [1, 3, 64])
@pytest.mark.parametrize("direction", ["store", "load"])
async def test_the_kernel_moves_every_page_whatever_the_grid(programs: int, direction: str) -> None:
    """Pages longer than one kernel step (`CHUNK` 8-byte words) and of odd length (a
    1-byte word), 5 non-contiguous blocks over 2 groups: with 1 program (every page in
    one loop), 3 (uneven shares) and 64 (more programs than pages)."""
    need_triton()
    long_page = CHUNK * 8 * 2 + 24  # two full steps and a tail
    rig = Rig(
        torch.device("cpu"),
        [[long_page, 40], [3, 3, 3]],
        factor=1,
        num_gpu_blocks=[9, 7],
        num_slots=6,
        copy=("bounded", "auto"),
        bounded_programs=programs,
    )
    spec = TransferSpec(direction, [[8, 1, 5], [6, 0]], [[4, 0, 2], [5, 3]], [0, 0])  # type: ignore[arg-type]
    result = await run(rig, spec)
    assert result.backend == "bounded"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
async def test_auto_moves_small_pages_with_the_bounded_kernel_on_cuda() -> None:
    need_triton()
    rig = Rig(
        torch.device("cuda"),
        [[SMALL] * 4],
        factor=1,
        num_gpu_blocks=8,
        num_slots=6,
        copy=("auto", "auto"),
    )
    for direction in ("store", "load"):
        spec = TransferSpec(direction, [[5, 1, 7]], [[0, 4, 2]], [0])  # type: ignore[arg-type]
        assert (await run(rig, spec)).backend == "bounded"
    rig.worker.close()


@pytest.mark.parametrize(
    ("programs", "want"), [(None, {"store": 8, "load": 32}), (5, {"store": 5, "load": 5})]
)
async def test_each_direction_launches_on_its_own_grid(
    programs: int | None, want: dict[str, int]
) -> None:
    """Stores write over the bus and need few thread blocks, loads read and need more
    (`DEFAULT_PROGRAMS`); `bounded_programs=N` sets both."""
    need_triton()
    rig = Rig(
        torch.device("cpu"),
        [[64, 64]],
        factor=1,
        copy=("bounded", "auto"),
        bounded_programs=programs,
    )
    backend = rig.worker._backends.small
    launched: list[int] = []
    original = backend._launch  # type: ignore[union-attr]

    def recording(grid: int, *args: object, **kwargs: object) -> None:
        launched.append(grid)
        original(grid, *args, **kwargs)

    backend._launch = recording  # type: ignore[union-attr]
    for direction in ("store", "load"):
        await run(rig, TransferSpec(direction, [[2, 9]], [[1, 4]], [0]))  # type: ignore[arg-type]
    assert launched == [want["store"], want["load"]]
