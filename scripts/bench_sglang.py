"""tierkv's nvme tier beside SGLang's own `file` backend, both through SGLang's storage
interface as its cache controller drives them, on the same disk.

Both backends are built by SGLang's `StorageBackendFactory` (tierkv through the
`dynamic` config) over one host pool (the stand-in with SGLang's page arithmetic,
`tierkv.integrations.sglang.stand_in`). Each call moves one batch of 128 pages, as
SGLang's I/O and backup threads do (`STORAGE_BATCH_SIZE`):

- tierkv (`interface_v1`): `batch_set_v1(keys, host_indices)` and
  `batch_get_v1(keys, host_indices)`, in place in the host pool (the controller's
  `_page_set_zero_copy` / `_page_get_zero_copy`).
- `file` (no zero-copy calls): the controller's `_generic_page_set` (`get_data_page`
  per page, then `batch_set`) and `_generic_page_get` (`batch_get` into dummy pages,
  then `set_from_flat_data_page` per page), copied here call for call.

Rounds interleave the two (the order flips each round), every round with fresh page
hashes, so a set writes and a get reads what the round wrote; every page read is
compared with what was written (outside the timing). Reads come from the page cache
on both sides (the pages were just written; this bench does not drop caches). The
nvme tier checks a checksum on every read and writes a header per block, with
`fsync: never` (SGLang's file backend never syncs either; `--fsync always` for the
durable setting). Prints pages/s per operation, the median over rounds, and the ratio.

An MHA page (page_first) is two regions, its K and its V across all layers, so tierkv
moves two blocks per page. `--regions 1` gives tierkv a pool of the same page size
whose pages are one region each (MLA-shaped: one buffer, no K/V split; same tokens per
page and layers), to measure what one block per page would give; the `file` backend
keeps the MHA pool and does exactly the work it does by default (its file per page is
the whole page either way).

    python scripts/bench_sglang.py [--pages-kib 64,1024] [--batches 8] [--rounds 5]
        [--io-concurrency 8] [--fsync never] [--regions 2] [--nvme-layout slab|files]
        [--full] [--mac]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

BATCH = 128
RUN = secrets.token_hex(4)
TIERKV = {
    "backend_name": "tierkv",
    "module_path": "tierkv.integrations.sglang",
    "class_name": "TierkvHiCacheStorage",
    "interface_v1": 1,
}


def storage_config(extra: dict[str, Any], mla: bool = False, page_first: bool = True) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=page_first,
        model_name="bench/model", extra_config=extra,
    )


def build(name: str, extra: dict[str, Any], pool: Any) -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = storage_config(extra, mla=pool.mla, page_first=pool.layout == "page_first")
    backend = StorageBackendFactory.create_backend(name, config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def pool_of(page_kib: int, pages: int, regions: int = 2, layout: str = "page_first") -> Any:
    """A pool laid out as `layout` whose pages are `page_kib` KiB (4 layers): MHA with
    128-dim heads (two regions a page in page_first, K and V; 2 x 4 in layer_first), or
    with `regions=1` MLA-shaped, one region a page of the same tokens, its dim the MHA
    page's K and V heads side by side."""
    from tierkv.integrations.sglang.stand_in import HostPoolStandIn

    tokens, heads = (16, 2) if page_kib == 64 else (page_kib // 16, 8)
    if regions == 2:
        pool = HostPoolStandIn(pages=pages, page_size=tokens, layer_num=4, head_num=heads,
                               head_dim=128, dtype=torch.bfloat16, layout=layout)
    elif regions == 1:
        pool = HostPoolStandIn(pages=pages, page_size=tokens, layer_num=4,
                               head_dim=2 * heads * 128, dtype=torch.bfloat16, mla=True,
                               layout=layout)
    else:
        raise ValueError(f"regions must be 1 or 2, got {regions}")
    page = 2 * 4 * tokens * heads * 128 * 2
    assert page == page_kib << 10, (page, page_kib)
    assert pool.get_data_page(0).numel() * 2 == page, (pool.get_data_page(0).shape, page)
    return pool


class Run:
    """One backend over one pool: set then get `batches` batches of fresh pages."""

    def __init__(self, name: str, backend: Any, pool: Any, zero_copy: bool) -> None:
        self.name, self.backend, self.pool, self.zero_copy = name, backend, pool, zero_copy
        self.set_rate: list[float] = []
        self.get_rate: list[float] = []

    def set_batch(self, keys: list[str], indices: torch.Tensor) -> bool:
        pool, p = self.pool, self.pool.page_size
        if self.zero_copy:
            return all(self.backend.batch_set_v1(keys, indices))
        data = [pool.get_data_page(indices[i * p]) for i in range(len(keys))]
        return bool(self.backend.batch_set(keys, data))

    def get_batch(self, keys: list[str], indices: torch.Tensor) -> int:
        pool, p = self.pool, self.pool.page_size
        if self.zero_copy:
            return sum(self.backend.batch_get_v1(keys, indices))
        dummies = [pool.get_dummy_flat_data_page() for _ in keys]
        pages = self.backend.batch_get(keys, dummies)
        count = 0
        for i, page in enumerate(pages):
            if page is None:
                break
            pool.set_from_flat_data_page(indices[i * p], page)
            count += 1
        return count

    def round(self, r: int, batches: int) -> None:
        n = batches * BATCH
        # a run's own keys: a tier reopened on a --dir an earlier run filled would hold
        # the same keys and take each set as a refresh, writing nothing
        keys = [f"{self.name}-{RUN}-r{r}-{i:08x}" for i in range(n)]
        src, dst = list(range(n)), list(range(n, 2 * n))
        fill(self.pool, src, r)
        # the token indices of each batch, as SGLang's controller holds them (a tensor
        # from its allocator): built before the clock starts, not timed with the calls
        batch = [slice(b * BATCH, (b + 1) * BATCH) for b in range(batches)]
        sources = [self.pool.indices(src[s]) for s in batch]
        targets = [self.pool.indices(dst[s]) for s in batch]
        started = time.perf_counter()
        for s, indices in zip(batch, sources):
            if not self.set_batch(keys[s], indices):
                raise RuntimeError(f"{self.name}: a set failed")
        self.set_rate.append(n / (time.perf_counter() - started))
        started = time.perf_counter()
        got = 0
        for s, indices in zip(batch, targets):
            got += self.get_batch(keys[s], indices)
        self.get_rate.append(n / (time.perf_counter() - started))
        if got != n:
            raise RuntimeError(f"{self.name}: {n - got} of {n} pages missed")
        bad = sum(
            self.pool.page_bytes(s) != self.pool.page_bytes(d) for s, d in zip(src, dst)
        )  # bytes, not values: random bits include NaNs
        if bad:
            raise RuntimeError(f"{self.name}: {bad} pages read back wrong")


def fill(pool: Any, pages: list[int], seed: int) -> None:
    """Random bytes in `pages` (the whole buffer, for speed; other pages are rewritten
    by the get before they are compared)."""
    generator = torch.Generator().manual_seed(seed)
    flat = pool.kv_buffer.view(torch.int16).view(-1)
    flat.copy_(torch.randint(-(2**15), 2**15, flat.shape, dtype=torch.int16,
                             generator=generator))


_MAC_ENV = "TIERKV_BENCH_SGLANG_MAC"
os.environ.setdefault(_MAC_ENV, os.urandom(32).hex())


def bench(
    page_kib: int,
    batches: int,
    rounds: int,
    root: Path,
    fsync: str,
    io_concurrency: int,
    regions: int = 2,
    layout: str = "page_first",
    nvme_layout: str = "slab",
    full: bool = False,
    mac: bool = False,
) -> dict[str, Any]:
    """`regions` per page on tierkv's side; the `file` backend's pool is always MHA;
    both laid out as `layout`. `full`: the nvme tier holds one round's pages, and an
    unmeasured round fills it first, so every measured set evicts a page (a server's
    steady state: the tier is full). `mac`: tierkv signs its frames (`mac_key_env`, a
    random secret)."""
    pages = 2 * batches * BATCH
    pools = {
        "tierkv": pool_of(page_kib, pages, regions, layout),
        "file": pool_of(page_kib, pages, layout=layout),
    }
    tierkv_dir, file_dir = root / f"tierkv-{page_kib}", root / f"file-{page_kib}"
    capacity = f"{4 * rounds * batches * BATCH * page_kib}KiB"
    if full:  # one round's pages, each a slot or a file of the page and a 4 KiB header
        capacity = f"{batches * BATCH * (page_kib + 4)}KiB"
    runs = [
        Run("tierkv", build("dynamic", {**TIERKV, "tiers": [
            {"type": "nvme", "path": str(tierkv_dir), "capacity": capacity, "fsync": fsync,
             "io_concurrency": io_concurrency, "layout": nvme_layout,
             **({"mac_key_env": _MAC_ENV} if mac else {})}
        ]}, pools["tierkv"]), pools["tierkv"], zero_copy=True),
        Run("file", build("file", {"file_storage_path": str(file_dir)}, pools["file"]),
            pools["file"], zero_copy=False),
    ]
    try:
        if full:  # fill the tier (and the file backend's directory alike), unmeasured
            for run in runs:
                run.round(-1, batches)
                run.set_rate.clear()
                run.get_rate.clear()
        for r in range(rounds):
            for run in runs if r % 2 == 0 else runs[::-1]:
                run.round(r, batches)
    finally:
        runs[0].backend.close()
    row: dict[str, Any] = {
        "page_kib": page_kib, "pages_per_round": batches * BATCH, "regions": regions
    }
    for run in runs:
        row[f"{run.name}_set"] = statistics.median(run.set_rate)
        row[f"{run.name}_get"] = statistics.median(run.get_rate)
    row["get_ratio"] = row["tierkv_get"] / row["file_get"]
    row["set_ratio"] = row["tierkv_set"] / row["file_set"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages-kib", default="64,1024", help="page sizes in KiB (64,1024)")
    parser.add_argument("--batches", type=int, default=8, help="128-page batches per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fsync", default="never", choices=("never", "always"))
    parser.add_argument("--io-concurrency", type=int, default=8,
                        help="the nvme tier's io_concurrency (its default: 8)")
    parser.add_argument("--regions", type=int, default=2, choices=(1, 2),
                        help="regions per page on tierkv's side: 2 (MHA, K and V; the "
                        "default) or 1 (an MLA-shaped pool of the same page size)")
    parser.add_argument("--layout", default="page_first", choices=("page_first", "layer_first"),
                        help="SGLang's --hicache-mem-layout of both pools (page_first; "
                        "layer_first is SGLang's own default)")
    parser.add_argument("--nvme-layout", default="slab", choices=("slab", "files"),
                        help="the nvme tier's layout (its default: slab)")
    parser.add_argument("--full", action="store_true",
                        help="the nvme tier holds one round's pages and is filled by an "
                        "unmeasured round first: every measured set evicts (steady state)")
    parser.add_argument("--mac", action="store_true",
                        help="tierkv signs its frames with a keyed MAC (mac_key_env)")
    parser.add_argument("--dir", default=None, help="where both write (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="tierkv-bench-sglang-"))
    rows = []
    try:
        for kib in (int(k) for k in args.pages_kib.split(",")):
            rows.append(
                bench(kib, args.batches, args.rounds, root, args.fsync, args.io_concurrency,
                      args.regions, args.layout, args.nvme_layout, args.full, args.mac)
            )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"128-page batches, {args.rounds} interleaved rounds, median pages/s; tierkv nvme "
          f"fsync={args.fsync}, io_concurrency={args.io_concurrency}, checksums on, "
          f"{args.regions} region(s) per tierkv page, {args.layout}, nvme layout "
          f"{args.nvme_layout}{', full tier (every set evicts)' if args.full else ''}"
          f"{', frames signed (MAC)' if args.mac else ''}")
    print("| page | tierkv set | file set | set ratio | tierkv get | file get | get ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['page_kib']} KiB | {row['tierkv_set']:,.0f} | {row['file_set']:,.0f} | "
              f"{row['set_ratio']:.2f}x | {row['tierkv_get']:,.0f} | {row['file_get']:,.0f} | "
              f"{row['get_ratio']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
