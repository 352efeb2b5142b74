"""The raw media over the network: plain redis-py for `redis` (`RawRedis`), plain
s3fs for `s3` (`RawS3`), each with the tier's own concurrency and credentials; Mooncake
Store's own client for `mooncake` (`RawMooncake`)."""

from __future__ import annotations

import importlib
import os
from typing import Any

import anyio
import torch

from tierkv.bench.raw import RawMedium, row_of
from tierkv.bench.timing import Batch


class RawRedis(RawMedium):
    """`redis`'s medium: plain redis-py, one SET/GET per block, the tier's
    `max_connections` in flight (concurrent single commands: faster than pipelines
    for MiB-sized values on this kind of machine)."""

    def __init__(self, tier: Any) -> None:  # a RedisTierConfig
        super().__init__(int(getattr(tier, "max_connections", 16)))
        self.tier = tier
        self.description = f"redis-py SET/GET, {self.width} in flight"
        self.prefix = f"tierkv-bench-raw:{os.getpid()}:"
        self.client: Any = None

    async def open(self) -> None:
        aioredis: Any = importlib.import_module("redis.asyncio")
        password = getattr(self.tier, "password", None)
        self.client = aioredis.Redis.from_url(
            str(self.tier.url),
            password=password.get_secret_value() if password is not None else None,
            max_connections=self.width,
        )

    async def put(self, i: int, row: memoryview) -> None:
        await self.client.set(f"{self.prefix}{i}", row)

    async def get(self, i: int, row: memoryview) -> None:
        row[:] = await self.client.get(f"{self.prefix}{i}")

    async def cleanup(self, n: int) -> None:
        names = [f"{self.prefix}{i}" for i in range(n)]
        for start in range(0, n, 1000):
            await self.client.delete(*names[start : start + 1000])

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()


class RawS3(RawMedium):
    """`s3`'s medium: plain s3fs `_pipe_file`/`_cat_file`, one object per block, the
    tier's `max_concurrency` in flight, same endpoint and credentials."""

    def __init__(self, tier: Any) -> None:  # an S3TierConfig
        super().__init__(int(getattr(tier, "max_concurrency", 16)))
        self.tier = tier
        self.description = f"s3fs put/get, {self.width} in flight"
        root = f"{tier.bucket}/{tier.prefix}".rstrip("/")
        self.root = f"{root}/tierkv-bench-raw-{os.getpid()}"
        self.fs: Any = None
        self.session: Any = None

    async def open(self) -> None:
        s3fs: Any = importlib.import_module("s3fs")
        t = self.tier
        kwargs: dict[str, Any] = {}
        if t.access_key_id is not None:
            kwargs["key"] = t.access_key_id
            kwargs["secret"] = t.secret_access_key.get_secret_value()
            if t.session_token is not None:
                kwargs["token"] = t.session_token.get_secret_value()
        if t.profile is not None:
            kwargs["profile"] = t.profile
        self.fs = s3fs.S3FileSystem(
            asynchronous=True,
            skip_instance_cache=True,
            endpoint_url=t.endpoint_url,
            client_kwargs={"region_name": t.region} if t.region else {},
            config_kwargs={  # like the tier: the bytes carry no botocore checksum
                "max_pool_connections": self.width,
                "request_checksum_calculation": "when_required",
                "response_checksum_validation": "when_required",
            },
            max_concurrency=self.width,
            **kwargs,
        )
        self.session = await self.fs.set_session()

    async def put(self, i: int, row: memoryview) -> None:
        # botocore takes bytes, not a memoryview: one copy, as the tier makes
        await self.fs._pipe_file(f"{self.root}/{i}", bytes(row))

    async def get(self, i: int, row: memoryview) -> None:
        row[:] = await self.fs._cat_file(f"{self.root}/{i}")

    async def cleanup(self, n: int) -> None:
        await self.fs._rm([f"{self.root}/{i}" for i in range(n)])

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


class RawMooncake(RawMedium):
    """`mooncake`'s medium: a `MooncakeDistributedStore` of its own (a pure client of
    the tier's master, lending no segment), `put` and `get` of each block's bytes
    from one Python thread, a batch per hop (no frame, no checksum)."""

    def __init__(self, tier: Any, block_bytes: int) -> None:  # a MooncakeTierConfig
        super().__init__(1)
        self.tier = tier
        self.block_bytes = block_bytes
        self.description = "MooncakeDistributedStore put/get, one thread"
        self.prefix = f"tierkv-bench-raw/{os.getpid()}/"
        self.client: Any = None
        self.thread = anyio.CapacityLimiter(1)

    async def open(self) -> None:
        store_module: Any = importlib.import_module("mooncake.store")
        t = self.tier
        store = store_module.MooncakeDistributedStore()
        code = await anyio.to_thread.run_sync(
            store.setup,
            t.local_hostname,
            t.metadata_server,
            0,
            max(int(t.local_buffer_size), 2 * self.block_bytes),  # put/get stage through it
            t.protocol,
            t.rdma_devices,
            t.master,
        )
        if code != 0:
            raise RuntimeError(f"mooncake setup against {t.master} failed: {code}")
        self.client = store

    def _put_rows(self, data: torch.Tensor, batch: Batch) -> None:
        for i in range(*batch):
            code = self.client.put(f"{self.prefix}{i}", row_of(data, i))
            if code != 0:
                raise RuntimeError(f"mooncake put of block {i} failed: {code}")

    def _get_rows(self, out: torch.Tensor, batch: Batch) -> None:
        for i in range(*batch):
            row_of(out, i)[:] = self.client.get(f"{self.prefix}{i}")

    async def store(self, data: torch.Tensor, batch: Batch) -> None:
        await anyio.to_thread.run_sync(self._put_rows, data, batch, limiter=self.thread)

    async def load(self, out: torch.Tensor, batch: Batch) -> None:
        await anyio.to_thread.run_sync(self._get_rows, out, batch, limiter=self.thread)

    async def cleanup(self, n: int) -> None:
        names = [f"{self.prefix}{i}" for i in range(n)]
        await anyio.to_thread.run_sync(self.client.batch_remove, names, True)

    async def close(self) -> None:
        if self.client is not None:
            await anyio.to_thread.run_sync(self.client.close)
