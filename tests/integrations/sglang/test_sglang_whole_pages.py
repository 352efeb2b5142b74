"""A page of several regions is one block of all its regions when every tier accepts
regions (`GatherView`), whatever the layout: an MHA pool laid out page_first (K in the
first half of `kv_buffer`, V in the second), layer_first (K and V of each layer: 2 x
layers regions), page_first_direct, a split MLA pool (K and V in two buffers, two
sizes): one key, one nvme file per page, read and written in place; with a tier that
does not (the sqlite plugin), region by region as before."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from tierkv.integrations.sglang.pages import WHOLE_PAGE, page_keys

PAGES = 6


def nvme_files(root: Path) -> list[Path]:
    """The block files under `root` (these tests ask for the file layout: a page is
    one file there; the slab layout's slots are counted by its own tests)."""
    return [p for p in root.rglob("*.blk") if p.is_file()]


def slab_blocks(root: Path) -> int:
    """The slots written in the slab files under `root` (`layout: slab`): their disk
    bytes, less each file's superblock page, over the slot size its superblock names."""
    written = 0
    slot = 0
    for path in root.rglob("*.kvslab"):
        head = path.read_bytes()[:40]
        slot = struct.unpack_from("<Q", head, 24)[0] + 4096  # room + the header page
        written += path.stat().st_blocks * 512 - 4096
    return written // slot if slot else 0


def round_trip(rig: Any, pool: Any, backend: Any) -> None:
    hashes = rig.page_hashes(PAGES, "whole")
    rig.fill(pool, list(range(PAGES)), "whole")
    assert backend.batch_set_v1(hashes, pool.indices(list(range(PAGES)))) == [True] * PAGES
    assert backend.batch_exists(hashes) == PAGES
    targets = list(range(PAGES, 2 * PAGES))[::-1]
    assert backend.batch_get_v1(hashes, pool.indices(targets)) == [True] * PAGES
    for src, dst in zip(range(PAGES), targets):
        assert pool.page_bytes(dst) == pool.page_bytes(src)


def test_a_page_first_mha_page_is_one_nvme_file(rig: Any) -> None:
    pool = rig.pool(pages=2 * PAGES, layout="page_first")
    backend = rig.backend(pool, [rig.nvme("whole", layout="files")])
    kv = backend.kv
    assert kv.parts == 2 and kv.key_parts == 1 and kv.whole
    assert kv.lanes is not None
    (_, k_at, _, _), (_, v_at, _, _) = kv.lanes
    assert v_at - k_at == pool.kv_buffer[1].data_ptr() - pool.kv_buffer[0].data_ptr()
    round_trip(rig, pool, backend)
    assert len(nvme_files(rig.tmp_path / "whole")) == PAGES  # not 2 x PAGES


@pytest.mark.parametrize("layers", [1, 3, 8])
def test_a_layer_first_mha_page_is_one_nvme_file(rig: Any, layers: int) -> None:
    """SGLang's layer_first (its disaggregated decode's layout): a page is K and V of
    each layer, 2 x layers regions in one buffer; one block, one file of one frame
    (header + the page's bytes), read back byte for byte, in place."""
    pool = rig.pool(pages=2 * PAGES, layout="layer_first", layer_num=layers)
    backend = rig.backend(pool, [rig.nvme(f"layers{layers}", layout="files")])
    kv = backend.kv
    assert kv.parts == 2 * layers and kv.key_parts == 1 and len(kv.components) == 1
    assert kv.components[0].view.region_count == 2 * layers
    round_trip(rig, pool, backend)
    files = nvme_files(rig.tmp_path / f"layers{layers}")
    assert len(files) == PAGES  # not 2 x layers x PAGES
    assert {f.stat().st_size - backend.page_bytes for f in files} == {64}


def test_the_whole_page_key_is_no_region_key() -> None:
    (whole,) = page_keys(["h"], "|rank0", 2, whole=True)
    regions = page_keys(["h"], "|rank0", 2)[0]
    assert len(whole) == 1 and whole[0] not in regions
    assert whole[0][:-4] == regions[0][:-4] and whole[0][-4:] == WHOLE_PAGE.to_bytes(4, "big")


def sqlite(rig: Any, name: str) -> dict[str, Any]:
    """A tier that moves a block as one run of bytes (it does not accept regions)."""
    return {"type": "sqlite", "path": str(rig.tmp_path / f"{name}.db"), "capacity": "64MiB"}


def test_a_tier_that_moves_one_run_of_bytes_keeps_regions_apart(rig: Any) -> None:
    pool = rig.pool(pages=2 * PAGES, layout="page_first")
    backend = rig.backend(pool, [rig.nvme("mixed", layout="files"), sqlite(rig, "mixed")])
    assert not backend.kv.whole and backend.kv.key_parts == 2
    round_trip(rig, pool, backend)
    assert len(nvme_files(rig.tmp_path / "mixed")) == 2 * PAGES


@pytest.mark.parametrize(
    ("layout", "mla"),
    [("page_first", False), ("page_first_direct", False), ("layer_first", False),
     ("page_head", False), ("page_first", True), ("layer_first", True),
     ("page_first_direct", True), ("page_first_kv_split", True)],
)
@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("on_disk", ["files", "slab"])
def test_every_layout_round_trips_one_block_a_page_or_region_by_region(
    rig: Any, layout: str, mla: bool, whole: bool, on_disk: str
) -> None:
    """Every layout of the stand-in, byte for byte: one block (one file, or one slab
    slot) a page where every tier accepts regions; one block a region next to a tier
    that does not. An MLA page_first page is one region anyway (its region's own key)."""
    pool = rig.pool(pages=2 * PAGES, layout=layout, mla=mla, layer_num=3)
    name = f"{layout}-{mla}-{whole}"
    nvme = rig.nvme(name, layout=on_disk)
    tiers = [nvme] if whole else [nvme, sqlite(rig, name)]
    backend = rig.backend(pool, tiers, mla=mla)
    kv = backend.kv
    one_region = kv.parts == 1
    assert kv.whole == (whole and not one_region)
    assert kv.key_parts == (1 if kv.whole or one_region else kv.parts)
    round_trip(rig, pool, backend)
    root = rig.tmp_path / name
    held = len(nvme_files(root)) if on_disk == "files" else slab_blocks(root)
    assert held == PAGES * kv.key_parts


def test_a_page_stored_region_by_region_is_not_read_as_a_whole_page(rig: Any) -> None:
    """An nvme tier written by a chain with a tier that keeps regions apart, then read
    by a chain of nvme alone (whole pages): different keys, a miss, never wrong bytes."""
    pool = rig.pool(pages=2 * PAGES, layout="page_first")
    hashes = rig.page_hashes(PAGES, "apart")
    rig.fill(pool, list(range(PAGES)), "apart")
    apart = rig.backend(pool, [rig.nvme("shared", layout="files"), sqlite(rig, "shared")])
    assert apart.batch_set_v1(hashes, pool.indices(list(range(PAGES)))) == [True] * PAGES
    apart.close()
    whole = rig.backend(pool, [rig.nvme("shared", layout="files")])
    assert whole.kv.key_parts == 1
    assert whole.batch_exists(hashes) == 0


def test_a_page_whose_regions_moved_is_refused_not_misread(
    rig: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A host pool that names a page's V somewhere else than a half-buffer after its K
    (its layout changed under the backend): the call answers False and writes nothing,
    and the log says why."""
    pool = rig.pool(pages=2 * PAGES, layout="page_first")
    backend = rig.backend(pool, [rig.nvme("moved", layout="files")])
    assert backend.kv.key_parts == 1
    real = pool.get_page_buffer_meta

    def moved(indices: Any) -> Any:
        ptrs, sizes = real(indices)
        return [p + (sizes[0] if j % 2 else 0) for j, p in enumerate(ptrs)], sizes

    monkeypatch.setattr(pool, "get_page_buffer_meta", moved)
    hashes = rig.page_hashes(2, "moved")
    assert backend.batch_set_v1(hashes, pool.indices([0, 1])) == [False, False]
    assert "not where" in caplog.text
    monkeypatch.setattr(pool, "get_page_buffer_meta", real)
    assert backend.batch_exists(hashes) == 0


@pytest.mark.parametrize(("signed", "tiers", "header"), [(0, 1, 64), (0, 3, 64), (1, 2, 64),
                                                         (1, 1, 128), (2, 3, 128)])
def test_page_keys_make_frame_headers_a_multiple_of_64_bytes(
    signed: int, tiers: int, header: int
) -> None:
    """SGLang's host pools are 64-byte aligned: a header of a multiple of 64 bytes puts
    each region's bytes in a file at a distance of 0 or 64 bytes and more from its
    slot, where the kernel's copy is fast (`framing.aligned_key_bytes`). One length
    cannot align both signed and unsigned frames: it follows most tiers."""
    from tierkv.contract.framing import header_bytes
    from tierkv.integrations.sglang.pages import MIN_KEY_BYTES, key_bytes

    length = key_bytes(signed, tiers)
    (keys,) = page_keys(["h"], "|rank0", 2, length=length)
    assert {len(k) for k in keys} == {length} and length >= MIN_KEY_BYTES
    assert header_bytes(keys[0], mac=2 * signed > tiers) == header
    with pytest.raises(ValueError, match="page keys are"):
        page_keys(["h"], "|rank0", 2, length=MIN_KEY_BYTES - 1)


def test_the_adapter_reads_whole_pages_straight_into_the_pool(
    rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the adapter, no page of a 64-byte-aligned pool goes through the nvme
    tier's scratch buffer: every file's payload starts 64 bytes in."""
    from tierkv_nvme import blockfile

    framed: list[object] = []
    real = blockfile._Scratch.frame

    def spy(self: Any, dest: Any, head_bytes: int) -> Any:
        framed.append(head_bytes)
        return real(self, dest, head_bytes)

    monkeypatch.setattr(blockfile._Scratch, "frame", spy)
    monkeypatch.setattr(blockfile._Scratch, "_frame_of_regions", spy)
    pool = rig.pool(pages=2 * PAGES, layout="page_first")
    assert pool.kv_buffer.data_ptr() % 64 == 0
    backend = rig.backend(pool, [rig.nvme("aligned", layout="files")])
    round_trip(rig, pool, backend)
    assert framed == []
    files = nvme_files(rig.tmp_path / "aligned")
    assert len(files) == PAGES
    assert {f.stat().st_size - backend.page_bytes for f in files} == {64}


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_page_asked_twice_in_one_load_fills_its_first_copy_only(
    rig: Any, layout: str
) -> None:
    """SGLang never asks so, but a call that does gets its first copy filled and
    False for the second (one tier job has each key once), whole pages or not."""
    pool = rig.pool(pages=2 * PAGES, layout=layout)
    backend = rig.backend(pool, [rig.nvme(f"twice-{layout}", layout="files")])
    assert backend.kv.whole
    hashes = rig.page_hashes(2, "twice")
    rig.fill(pool, [0, 1], "twice")
    assert backend.batch_set_v1(hashes, pool.indices([0, 1])) == [True, True]
    asked = [hashes[0], hashes[1], hashes[0]]
    assert backend.batch_get_v1(asked, pool.indices([5, 6, 7])) == [True, True, False]
    assert pool.page_bytes(5) == pool.page_bytes(0)
    assert pool.page_bytes(6) == pool.page_bytes(1)
