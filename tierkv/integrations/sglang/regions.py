"""An SGLang host pool below tierkv: the KV pool (v1 calls) and each extra pool of a
hybrid model (v2 calls: Mamba state, sliding-window KV, ...).

`host_pool.get_page_buffer_meta(indices)` gives, for each page of a call, the address
and size of each of its regions: two per page for an MHA KV pool laid out page_first
(the page's K and its V across all layers), 2 x layers for layer_first, one for MLA;
a Mamba pool's temporal state and one conv state per conv buffer, each its own size.

**Whole pages.** Where every tier of the chain `accepts_regions` and a page has
several regions, the pool is one component over a `GatherView`: one *lane* per region
of a page (its buffer, where page 0's region lies, the bytes from one page's region to
the next, its size, read from the pool's first two pages and checked on every call),
and a page is one block of all its regions, under one key
(`make_offload_key(H(suffix, page hash), pages.WHOLE_PAGE)`): one file, one header,
one checksum, one index entry per page, written with one `pwritev` from the regions
and read with one `preadv` into them, in place. That covers every layout SGLang 0.5.23
offers: MHA page_first / page_first_direct / page_head (K and V half a buffer apart),
layer_first (2 x layers lanes: K and V of each layer), MLA layer_first (one lane a
layer) and page_first_kv_split (K and V in two buffers, of two sizes), a Mamba pool
(temporal and conv states, three buffers of three sizes).

Otherwise (a tier that moves a block as one run of bytes, or a page of one region)
each region is a block of its own: regions of one size in one buffer lie on multiples
of that size (SGLang allocates host pages whole), so each distinct (buffer, size) is a
*component*: a `PrimaryView` of region-sized slots over that buffer, read and written
in place (no copy), with its own instance of every tier in the chain (a `SyncChain`,
all on the process's one loop thread). A component's namespace is the pool's (its own
directory in an nvme tier); with several components each gets `|<name>:<index>` after
it. A page's region `j` is then the block `make_offload_key(H(suffix, page hash), j)`
(`pages.page_keys`); a page is present, read or written when all its regions are.

The rules for which pages a v2 hit needs follow SGLang (`PoolHitPolicy`): a pool of
`ALL_PAGES` needs every page of the prefix, `TRAILING_PAGES` the last
`len(transfer.keys)` pages before each possible end (so `restorable_prefix_pages`
lists every end every pool can serve, holes included), `BLOCK_GROUPS` never limits the
hit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierkv.contract.keys import OffloadKey
from tierkv.contract.slab import GatherView, PrimaryView
from tierkv.driver.sync_chain import SyncChain
from tierkv.integrations.sglang.claims import ExistsClaims
from tierkv.integrations.sglang.pages import (
    MIN_KEY_BYTES,
    host_bytes,
    page_keys,
    whole_page_keys,
)

logger = logging.getLogger(__name__)

ChainFactory = Callable[[PrimaryView], SyncChain]
"""Builds the tier chain of one component (the adapter's settings, over its view)."""


def pool_tensors(pool: Any) -> list[Any]:
    """Every tensor (or tensor in a list) that is an attribute of `pool`, largest
    first: a region is found in the whole buffer (`kv_buffer`) before any view of part
    of it (`k_buffer = kv_buffer[0]`), so one buffer is one slab."""
    found: list[Any] = []
    for value in vars(pool).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if hasattr(item, "data_ptr") and hasattr(item, "element_size"):
                found.append(item)
    return sorted(found, key=lambda t: -t.numel() * t.element_size())


def _containing(tensors: list[Any], ptr: int) -> Any:
    for tensor in tensors:
        start = int(tensor.data_ptr())
        if start <= ptr < start + tensor.numel() * tensor.element_size():
            return tensor
    raise ValueError(f"a page region at {ptr:#x} lies in none of the pool's buffers")


@dataclass
class Component:
    """Regions of one size in one buffer: a slab of slots and its tiers."""

    view: PrimaryView
    base: int
    size: int
    regions: tuple[int, ...]  # region indices (within a page) that live here
    chain: SyncChain


class RegionPool:
    """One host pool below tierkv (see the module docstring)."""

    def __init__(
        self,
        pool: Any,
        suffix: str,
        namespace: str,
        make_chain: ChainFactory,
        name: str = "kv",
        *,
        whole_pages: bool = False,
        key_bytes: int = MIN_KEY_BYTES,
    ) -> None:
        import torch

        self.key_bytes = key_bytes
        """The length of the pages' keys (`pages.key_bytes`)."""
        self.pool = pool
        self.name = name
        self._claims = ExistsClaims()
        self.suffix = suffix
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        if not ptrs:
            raise ValueError(f"host pool {type(pool).__name__} names no region of a page")
        self.parts = len(ptrs)
        self.region_bytes = tuple(int(size) for size in sizes)
        """Bytes of each region of a page, in order."""
        self.lanes: list[tuple[Any, int, int, int]] | None = None
        """Per region of a page stored whole: (buffer, offset of page 0's region in it,
        bytes from one page's region to the next, bytes); None: region by region."""
        if whole_pages and self.parts > 1:
            self.lanes = _page_lanes(pool, self.page_size, ptrs, sizes)
        groups = self._components(pool, ptrs, sizes) if self.lanes is None else [(None, 0, [0])]
        self.key_parts = 1 if self.lanes is not None else self.parts
        """Keys (blocks) per page: 1 for a page stored whole, else one per region."""
        self.components: list[Component] = []
        self.component_of: dict[int, int] = {}
        try:
            for c, (tensor, size, regions) in enumerate(groups):
                space = namespace if len(groups) == 1 else f"{namespace}|{name}:{c}"
                view: PrimaryView
                if self.lanes is not None:
                    view = self._gather_view(pool, space)
                    base, size = 0, self.page_bytes
                else:
                    data = host_bytes(tensor)
                    view = PrimaryView(data[: data.nbytes - data.nbytes % size], size, space)
                    base = int(tensor.data_ptr())
                chain = make_chain(view)
                self.components.append(Component(view, base, size, tuple(regions), chain))
                for j in regions:
                    self.component_of[j] = c
            self._region_components = np.array(
                [self.component_of[j] for j in range(self.key_parts)], dtype=np.int64
            )
            self._bases = np.array([c.base for c in self.components], dtype=np.int64)
            self._sizes = np.array([c.size for c in self.components], dtype=np.int64)
            self._counts = np.array([c.view.num_blocks for c in self.components], dtype=np.int64)
            self._slots(torch.arange(self.page_size, dtype=torch.int64))  # else refuse now
        except BaseException:
            self.close()
            raise

    @property
    def whole(self) -> bool:
        """Whether a page is one block of all its regions (`GatherView`)."""
        return self.lanes is not None

    @property
    def page_bytes(self) -> int:
        return sum(self.region_bytes)

    def _gather_view(self, pool: Any, namespace: str) -> GatherView:
        """A `GatherView` of the pool's pages: one lane per region of a page."""
        assert self.lanes is not None
        buffers: dict[int, memoryview] = {}
        lanes = []
        for tensor, offset, stride, size in self.lanes:
            data = buffers.get(id(tensor))
            if data is None:
                data = buffers[id(tensor)] = host_bytes(tensor)
            lanes.append((data, offset, stride, size))
        pages = _page_count(pool, self.page_size)
        view = GatherView(lanes, namespace, num_blocks=pages)
        starts = [int(t.data_ptr()) + offset for t, offset, _, _ in self.lanes]
        self._lane_starts = np.array(starts, dtype=np.int64)
        self._lane_strides = np.array([lane[2] for lane in self.lanes], dtype=np.int64)
        self._lane_sizes = np.array([lane[3] for lane in self.lanes], dtype=np.int64)
        return view

    @staticmethod
    def _components(pool: Any, ptrs: Sequence[int], sizes: Sequence[int]) -> list[Any]:
        """(buffer, size, region indices) per distinct (buffer, size) of a page."""
        tensors = pool_tensors(pool)
        groups: dict[tuple[int, int], tuple[Any, int, list[int]]] = {}
        for j, (ptr, size) in enumerate(zip(ptrs, sizes)):
            tensor = _containing(tensors, int(ptr))
            groups.setdefault((id(tensor), int(size)), (tensor, int(size), []))[2].append(j)
        return list(groups.values())

    def close(self) -> None:
        """Close every component's tiers and let go of the buffers."""
        components, self.components = self.components, []
        for component in components:
            component.chain.close()
        for component in components:
            try:
                component.view.release()
            except BufferError:
                logger.warning("tierkv: a view of SGLang's host pool %s is in use", self.name)

    @property
    def namespace(self) -> str:
        return self.components[0].view.namespace if self.components else ""

    @property
    def closed(self) -> bool:
        return not self.components or any(c.chain.closed for c in self.components)

    def keys(self, page_hashes: Sequence[str]) -> list[list[OffloadKey]]:
        return page_keys(
            page_hashes,
            self.suffix,
            self.parts,
            whole=self.lanes is not None,
            length=self.key_bytes,
        )

    def _split(self, per_page: list[list[OffloadKey]]) -> list[list[OffloadKey]]:
        """The keys of `per_page` by component."""
        split: list[list[OffloadKey]] = [[] for _ in self.components]
        for page in per_page:
            for j, key in enumerate(page):
                split[self.component_of[j]].append(key)
        return split

    def present(
        self, page_hashes: Sequence[str], owner: str | None = None, tenant: str | None = None
    ) -> list[bool]:
        """Per page: every region is held by some tier. With an `owner` (one
        `batch_exists` call) the regions found are claimed in their tiers until the
        load that reads them ends (`move`) or the tier's `claim_lease` runs out, so a
        store in between cannot evict what SGLang was told it will find. The tiers are
        asked for `tenant` (`ReqContext.tenant`)."""
        per_page = self.keys(page_hashes)
        found: dict[OffloadKey, bool] = {}
        end = time.monotonic() + self._deadline("lookup")
        for component, keys in zip(self.components, self._split(per_page)):
            budget = end - time.monotonic()
            flags = component.chain.present(keys, budget, owner, tenant)
            found.update(zip(keys, flags))
            if owner is not None:
                self._claims.note(owner, [k for k, f in zip(keys, flags) if f])
        return [all(found.get(k, False) for k in page) for page in per_page]

    def unclaim(self, owner: str, page_hashes: Sequence[str]) -> None:
        """End `owner`'s claims on these pages: found, but past the prefix SGLang
        will fetch."""
        if not page_hashes:
            return
        for component, keys in zip(self.components, self._split(self.keys(page_hashes))):
            self._claims.forget(owner, keys)
            component.chain.let_go(owner, keys)

    def _deadline(self, what: str) -> float:
        """One engine call's deadline across the components (each a tier chain)."""
        chains = [c.chain for c in self.components]
        if what == "lookup":
            return max((c.lookup_timeout for c in chains), default=0.0)
        return max((c.job_deadline for c in chains), default=0.0)

    def _slots(self, host_indices: Any) -> list[int]:
        """The slot (in its component) of every key of the pages at `host_indices`,
        page by page; ValueError for a region that is not a slot of its component (or,
        for a page stored whole, not at its place after the page's first region).
        Array arithmetic over the call's regions (256 per 128-page MHA call)."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        pages = len(host_indices) // self.page_size
        if len(ptrs) != pages * self.parts:
            raise ValueError(
                f"pool {self.name}: {len(ptrs)} regions for {pages} pages; "
                f"expected {self.parts} per page"
            )
        if not pages:
            return []
        starts = np.asarray(ptrs, dtype=np.int64)
        region_sizes = np.asarray(sizes, dtype=np.int64)
        if self.lanes is not None:
            return self._page_slots(
                starts.reshape(pages, self.parts), region_sizes.reshape(pages, self.parts)
            )
        # per key of the call: its component's base, slot size and slot count
        which = np.tile(self._region_components, pages)
        base, size, count = self._bases[which], self._sizes[which], self._counts[which]
        slot, rest = np.divmod(starts - base, size)
        bad = (region_sizes != size) | (rest != 0)
        bad |= (slot < 0) | (slot >= count)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"pool {self.name}: a page region ({int(region_sizes[i])} bytes) is not a "
                f"{int(size[i])}-byte slot of its buffer"
            )
        return slot.tolist()  # type: ignore[no-any-return]

    def _page_slots(self, grid: Any, sizes: Any) -> list[int]:
        """The slot of each page stored whole: where its first region lies in the first
        lane; ValueError when any region of a page is not where that slot's lane has
        it (the pool's layout changed) or not of its lane's size."""
        slot, rest = np.divmod(grid[:, 0] - self._lane_starts[0], self._lane_strides[0])
        count = int(self._counts[0])
        bad = (rest != 0) | (slot < 0) | (slot >= count)
        expected = self._lane_starts[None, :] + slot[:, None] * self._lane_strides[None, :]
        misplaced = (grid != expected).any(axis=1) | (sizes != self._lane_sizes[None, :]).any(
            axis=1
        )
        if (bad | misplaced).any():
            i = int(np.argmax(bad | misplaced))
            raise ValueError(
                f"pool {self.name}: the regions of page {i} of the call are not where this "
                "pool's first pages put them (a page is stored whole, as one block of its "
                f"regions; slot {int(slot[i])} of {count})"
            )
        return slot.tolist()  # type: ignore[no-any-return]

    def move(
        self,
        kind: str,
        page_hashes: Sequence[str],
        host_indices: Any,
        tenant: str | None = None,
    ) -> list[bool]:
        """Load or store the pages at `host_indices` (`page_size` indices a page) for
        `tenant`; per page: every region moved. A page asked twice in one load: only its
        first copy is filled, the other answers False."""
        if len(host_indices) != len(page_hashes) * self.page_size:
            raise ValueError(
                f"pool {self.name}: {len(host_indices)} host indices for "
                f"{len(page_hashes)} pages of {self.page_size}"
            )
        if not page_hashes:
            return []
        slots = self._slots(host_indices)
        per_page: list[list[OffloadKey]] = []
        if self.lanes is not None:  # whole pages (one component): flat lists
            keys = whole_page_keys(page_hashes, self.suffix, self.key_bytes)
            work = [_first_slots(keys, slots)]
        else:
            per_page = self.keys(page_hashes)
            work = [{} for _ in self.components]
            parts = self.key_parts
            for i, page in enumerate(per_page):
                for j, key in enumerate(page):
                    work[self.component_of[j]].setdefault(key, slots[i * parts + j])
        done: set[OffloadKey] = set()
        end = time.monotonic() + self._deadline("job")
        for component, pairs in zip(self.components, work):
            move = component.chain.load if kind == "load" else component.chain.store
            done |= move(list(pairs), list(pairs.values()), end - time.monotonic(), tenant)
            if kind == "load" and self._claims:  # the claims that promised these are done
                for owner, claimed in self._claims.ending(list(pairs)).items():
                    component.chain.let_go(owner, claimed)
        if not per_page:
            answers = [key in done for key in keys]
        else:
            answers = [all(k in done for k in page) for page in per_page]
        if kind == "load" and len(set(page_hashes)) < len(page_hashes):
            seen: set[str] = set()
            for i, page_hash in enumerate(page_hashes):
                answers[i] = answers[i] and page_hash not in seen
                seen.add(page_hash)
        return answers

    def remove(self, page_hashes: Sequence[str]) -> None:
        """Ask every tier to drop these pages (a hint)."""
        for component, keys in zip(self.components, self._split(self.keys(page_hashes))):
            component.chain.remove_all(keys)


def _first_slots(keys: Sequence[OffloadKey], slots: Sequence[int]) -> dict[OffloadKey, int]:
    """Key -> slot, the first slot where a key comes twice (a page asked twice in one
    call is filled once)."""
    pairs = dict(zip(keys, slots))
    if len(pairs) < len(keys):
        pairs = {}
        for key, slot in zip(keys, slots):
            pairs.setdefault(key, slot)
    return pairs


def _page_count(pool: Any, page_size: int) -> int | None:
    """The host pages of `pool`, where it says (`size` tokens or slots)."""
    size = getattr(pool, "size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return max(1, size // page_size)
    return None


def _page_lanes(
    pool: Any, page_size: int, ptrs: Sequence[int], sizes: Sequence[int]
) -> list[tuple[Any, int, int, int]] | None:
    """Per region of a page: (buffer, offset of page 0's region, bytes between one
    page's region and the next, bytes), read from the pool's first two pages (the
    pool's layout, checked again on every call); None when the second page's regions
    are not the first's shifted (a pool of one page, one that refuses, regions that
    move otherwise): the pool is stored region by region."""
    import torch

    try:
        second, second_sizes = pool.get_page_buffer_meta(
            torch.arange(page_size, 2 * page_size, dtype=torch.int64)
        )
    except Exception:
        return None
    if len(second) != len(ptrs) or [int(x) for x in second_sizes] != [int(x) for x in sizes]:
        return None
    tensors = pool_tensors(pool)
    lanes = []
    for first, then, size in zip(ptrs, second, sizes):
        stride, size = int(then) - int(first), int(size)
        if stride < size:  # not one region after another, page by page
            return None
        try:
            tensor = _containing(tensors, int(first))
        except ValueError:
            return None
        lanes.append((tensor, int(first) - int(tensor.data_ptr()), stride, size))
    return lanes


def restorable_ends(
    kv_pages: int, present: list[bool], policy: str, trailing: int
) -> tuple[list[int], int] | None:
    """The prefix lengths (1..kv_pages) one pool can serve, and its own boundary (the
    longest); None when the policy never limits the hit (`block_groups`)."""
    if policy == "all_pages":
        boundary = next((i for i in range(kv_pages) if not present[i]), kv_pages)
        return list(range(1, boundary + 1)), boundary
    if policy == "trailing_pages":
        window = max(1, trailing)
        ends = [end for end in range(1, kv_pages + 1) if all(present[max(0, end - window) : end])]
        return ends, max(ends, default=0)
    return None
