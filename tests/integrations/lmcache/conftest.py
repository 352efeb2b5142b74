"""LMCache 0.5.6's REAL classes: its L2 adapter config parser and factory (the plugin
loader builds the tierkv adapter from the `--l2-adapter` JSON), its memory objects
over one L1 buffer, its `ObjectKey` and `Bitmap`, its event fds. LMCache is imported
lazily: where it is missing these tests skip, and under CI=true they fail
(`bash scripts/setup-lmcache.sh` installs it).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import select
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierkv.testing import missing_server

PLUGIN = {
    "type": "plugin",
    "module_path": "tierkv.integrations.lmcache",
    "class_name": "TierkvL2Adapter",
}
WAIT = 20.0
"""Seconds a test waits for an event fd before failing (results come much sooner)."""


def lmcache() -> Any:
    try:
        import lmcache.v1.distributed.l2_adapters as l2
        from lmcache.v1.distributed.l2_adapters import config
    except Exception as exc:
        missing_server("lmcache 0.5.6 (bash scripts/setup-lmcache.sh)", exc)
    return l2, config


def adapter_json(tiers: list[dict[str, Any]], **params: Any) -> str:
    return json.dumps({**PLUGIN, "adapter_params": {"tiers": tiers, **params}})


class L1:
    """An L1 buffer as LMCache's server keeps one, handing out `TensorMemoryObj`s
    over its bytes (the objects a controller gives an adapter)."""

    def __init__(self, nbytes: int) -> None:
        import torch
        from lmcache.v1.distributed.internal_api import L1MemoryDesc

        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self.used = 0
        self.desc = L1MemoryDesc(ptr=self.buffer.data_ptr(), size=nbytes, align_bytes=256)

    def obj(self, size: int, seed: str | None = None) -> Any:
        """An object of `size` bytes (filled with bytes derived from `seed`)."""
        import torch
        from lmcache.v1.memory_management import (
            MemoryFormat,
            MemoryObjMetadata,
            TensorMemoryObj,
        )

        start = -(-self.used // 256) * 256
        assert start + size <= self.buffer.numel(), "the test's L1 is full"
        self.used = start + size
        raw = self.buffer[start : start + size]
        if seed is not None:
            raw.copy_(torch.frombuffer(bytearray(pattern(seed, size)), dtype=torch.uint8))
        meta = MemoryObjMetadata(
            shape=torch.Size([size]),
            dtype=torch.uint8,
            address=raw.data_ptr(),
            phy_size=size,
            fmt=MemoryFormat.KV_2LTD,
            ref_count=1,
        )
        return TensorMemoryObj(raw, meta, parent_allocator=None)


def pattern(seed: str, size: int) -> bytes:
    """Distinct, checkable bytes per seed."""
    block = hashlib.blake2b(seed.encode(), digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


def content(obj: Any) -> bytes:
    return bytes(obj.byte_array)


def key(i: int, *, model: str = "org/model", rank: int = 0, group: int = 0, salt: str = "") -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(
        chunk_hash=hashlib.sha256(f"chunk{i}".encode()).digest()[:16],
        model_name=model,
        kv_rank=rank,
        object_group_id=group,
        cache_salt=salt,
    )


def wait_fd(fd: int, timeout: float = WAIT) -> bool:
    from lmcache.v1.platform import consume_fd

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(timeout * 1000):
        return False
    with contextlib.suppress(BlockingIOError):
        consume_fd(fd)
    return True


def bits(bitmap: Any, n: int) -> list[bool]:
    return [bool(bitmap.test(i)) for i in range(n)]


class Driver:
    """Calls an adapter as LMCache's controllers do: submit, wait on the kind's event
    fd, take the result (one thread per kind of call, as LMCache has)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    def store(self, keys: list[Any], objects: list[Any], timeout: float = WAIT) -> Any:
        a = self.adapter
        task = a.submit_store_task(keys, objects)
        return self._wait(
            a.get_store_event_fd(), lambda: a.pop_completed_store_tasks().get(task), timeout
        )

    def lookup(self, keys: list[Any], timeout: float = WAIT) -> list[bool]:
        a = self.adapter
        task = a.submit_lookup_and_lock_task(keys, {})
        got = self._wait(
            a.get_lookup_and_lock_event_fd(), lambda: a.query_lookup_and_lock_result(task), timeout
        )
        return bits(got, len(keys))

    def load(self, keys: list[Any], objects: list[Any], timeout: float = WAIT) -> list[bool]:
        a = self.adapter
        task = a.submit_load_task(keys, objects)
        got = self._wait(a.get_load_event_fd(), lambda: a.query_load_result(task), timeout)
        return bits(got, len(keys))

    @staticmethod
    def _wait(fd: int, take: Any, timeout: float) -> Any:
        """The result once the fd says so (another caller may consume a signal meant
        for this task too: look again after each wake, and once before waiting)."""
        import time

        ends = time.monotonic() + timeout
        while True:
            got = take()
            if got is not None:
                return got
            left = ends - time.monotonic()
            assert left > 0, "no result within the wait"
            wait_fd(fd, min(left, 0.5))


class Rig:
    """Adapters built by LMCache's plugin loader from the JSON (closed at the end)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.made: list[Any] = []
        # the helpers, for the test modules (imported by path, they cannot import these)
        self.L1, self.Driver, self.key, self.pattern = L1, Driver, key, pattern
        self.content, self.adapter_json = content, adapter_json

    def adapter(self, tiers: list[dict[str, Any]], l1: L1 | None = None, **params: Any) -> Any:
        l2, config = lmcache()
        parsed = config.parse_args_to_l2_adapters_config(
            argparse.Namespace(l2_adapter=[adapter_json(tiers, **params)])
        )
        made = l2.create_l2_adapter(
            parsed.adapters[0], l1_memory_desc=None if l1 is None else l1.desc
        )
        self.made.append(made)
        return made

    def nvme(self, name: str = "nvme", **fields: Any) -> dict[str, Any]:
        return {"type": "nvme", "path": str(self.tmp_path / name), "capacity": "64MiB", **fields}

    def close(self) -> None:
        for made in self.made:
            made.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    lmcache()
    made = Rig(tmp_path)
    yield made
    made.close()
