"""The extra host pools of hybrid models (SGLang's v2 calls): Mamba state, sliding
window KV, ... beside the KV pool, each with its own buffers.

A v2 pool's page regions need not share one buffer or one size: a Mamba pool's page is
its temporal state (in `temporal_buffer`) and one conv state per conv buffer, each its
own size. Each distinct (buffer, size) is a *component*: a `PrimaryView` of
region-sized slots over that buffer, with its own instance of every tier in the chain
(a `SyncChain` per component, all on the process's one loop thread; the namespace
names the pool, the rank and the component, so an nvme tier keeps each in its own
directory). A page's region `j` is the block `make_offload_key(H(suffix, pool, page
hash), j)`; a page is present, read or written when all its regions are.

The rules for which pages a v2 hit needs follow SGLang (`PoolHitPolicy`): a pool of
`ALL_PAGES` needs every page of the prefix, `TRAILING_PAGES` the last
`len(transfer.keys)` pages before each possible end (so `restorable_prefix_pages`
lists every end every pool can serve, holes included), `BLOCK_GROUPS` never limits the
hit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tierkv.contract.keys import OffloadKey
from tierkv.contract.slab import PrimaryView
from tierkv.driver.sync_chain import SyncChain
from tierkv.integrations.sglang.pages import host_bytes, page_keys

logger = logging.getLogger(__name__)

ChainFactory = Callable[[PrimaryView], SyncChain]


def pool_tensors(pool: Any) -> list[Any]:
    """Every tensor (or tensor in a list) that is an attribute of `pool`."""
    found: list[Any] = []
    for value in vars(pool).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if hasattr(item, "data_ptr") and hasattr(item, "element_size"):
                found.append(item)
    return found


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


class SidecarPool:
    """One v2 host pool below tierkv (see the module docstring)."""

    def __init__(self, pool: Any, name: str, suffix: str, namespace: str,
                 make_chain: Callable[[PrimaryView], SyncChain]) -> None:
        import torch

        self.pool = pool
        self.name = name
        self.suffix = f"{suffix}|{name}"
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        self.parts = len(ptrs)
        tensors = pool_tensors(pool)
        groups: dict[tuple[int, int], list[int]] = {}
        owners: dict[tuple[int, int], Any] = {}
        for j, (ptr, size) in enumerate(zip(ptrs, sizes)):
            tensor = _containing(tensors, int(ptr))
            owner = (id(tensor), int(size))
            groups.setdefault(owner, []).append(j)
            owners[owner] = tensor
        self.components: list[Component] = []
        self.component_of: dict[int, int] = {}
        try:
            for c, (owner, regions) in enumerate(groups.items()):
                tensor, size = owners[owner], owner[1]
                data = host_bytes(tensor)
                view = PrimaryView(data[: data.nbytes - data.nbytes % size], size,
                                   f"{namespace}|{name}:{c}")
                self.components.append(
                    Component(view, int(tensor.data_ptr()), size, tuple(regions), make_chain(view))
                )
                for j in regions:
                    self.component_of[j] = c
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for component in self.components:
            component.chain.close()
        self.components = []

    def _keys(self, page_hashes: Sequence[str]) -> list[list[OffloadKey]]:
        return page_keys(page_hashes, self.suffix, self.parts)

    def present(self, page_hashes: Sequence[str]) -> list[bool]:
        """Per page: every region is held by some tier."""
        per_page = self._keys(page_hashes)
        found: dict[OffloadKey, bool] = {}
        for c, component in enumerate(self.components):
            keys = [k for page in per_page for j, k in enumerate(page) if self.component_of[j] == c]
            found.update(zip(keys, component.chain.present(keys)))
        return [all(found.get(k, False) for k in page) for page in per_page]

    def move(self, kind: str, page_hashes: Sequence[str], host_indices: Any) -> list[bool]:
        """Load or store the pages at `host_indices`; per page: every region moved."""
        if len(host_indices) != len(page_hashes) * self.page_size:
            raise ValueError(
                f"pool {self.name}: {len(host_indices)} host indices for "
                f"{len(page_hashes)} pages of {self.page_size}"
            )
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        per_page = self._keys(page_hashes)
        work: list[dict[OffloadKey, int]] = [{} for _ in self.components]
        for i, page in enumerate(per_page):
            for j, key in enumerate(page):
                component = self.components[self.component_of[j]]
                ptr, size = int(ptrs[i * self.parts + j]), int(sizes[i * self.parts + j])
                slot, rest = divmod(ptr - component.base, component.size)
                if size != component.size or rest or not 0 <= slot < component.view.num_blocks:
                    raise ValueError(f"pool {self.name}: a region is not a slot of its buffer")
                work[self.component_of[j]].setdefault(key, slot)
        done: set[OffloadKey] = set()
        for component, pairs in zip(self.components, work):
            move = component.chain.load if kind == "load" else component.chain.store
            done |= move(list(pairs), list(pairs.values()))
        return [all(k in done for k in page) for page in per_page]


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
        ends = [
            end
            for end in range(1, kv_pages + 1)
            if all(present[max(0, end - window) : end])
        ]
        return ends, max(ends, default=0)
    return None
