"""A raw medium: the plain client of a medium moving the same batches as tierkv
(`RawMedium`, the base every baseline implements), and the primary's own medium,
host memory (`RawMemcpy`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import torch

from tierkv.bench.timing import Batch
from tierkv.contract.tier import SecondaryTierManager


def row_of(t: torch.Tensor, i: int) -> memoryview:
    return memoryview(t[i].numpy())  # type: ignore[arg-type]


class RawMedium:
    """The plain client of a medium, moving the same batches as tierkv: by default
    each block of a batch on its own, at most `width` blocks in flight across all
    batches (the tier's own concurrency setting). Subclasses implement `put` and
    `get` (or `store` and `load` for whole batches)."""

    description = ""

    def __init__(self, width: int) -> None:
        self.width = width
        self.gate = anyio.Semaphore(width)

    async def put(self, i: int, row: memoryview) -> None:
        raise NotImplementedError

    async def get(self, i: int, row: memoryview) -> None:
        raise NotImplementedError

    async def _each(
        self, batch: Batch, t: torch.Tensor, fn: Callable[[int, memoryview], Awaitable[None]]
    ) -> None:
        async def one(i: int) -> None:
            async with self.gate:
                await fn(i, row_of(t, i))

        async with anyio.create_task_group() as tg:
            for i in range(*batch):
                tg.start_soon(one, i)

    async def store(self, data: torch.Tensor, batch: Batch) -> None:
        await self._each(batch, data, self.put)

    async def load(self, out: torch.Tensor, batch: Batch) -> None:
        await self._each(batch, out, self.get)

    async def open(self) -> None:
        pass

    async def before_load(self, tier: SecondaryTierManager | None) -> None:
        """Make the next load (raw, or `tier`'s when given) read the medium."""

    async def cleanup(self, n: int) -> None:
        pass

    async def close(self) -> None:
        pass


class RawMemcpy(RawMedium):
    """The primary's medium: host memory, one `copy_` of each batch into a slab."""

    description = "torch copy_"

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        super().__init__(1)
        self.slab = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)

    async def store(self, data: torch.Tensor, batch: Batch) -> None:
        self.slab[batch[0] : batch[1]].copy_(data[batch[0] : batch[1]])

    async def load(self, out: torch.Tensor, batch: Batch) -> None:
        out[batch[0] : batch[1]].copy_(self.slab[batch[0] : batch[1]])
