"""SGLang's REAL storage classes (`HiCacheStorageConfig`, `StorageBackendFactory` with
the `dynamic` backend config, `HiCacheStorage`) over a stand-in host pool
(`tierkv.integrations.sglang.stand_in`, which says why SGLang's own pool does not
import on a CPU machine). SGLang is imported lazily: where it is missing these tests
skip, and under CI=true they fail (`bash scripts/setup-sglang.sh` installs it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierkv.testing import missing_server

BACKEND = {
    "backend_name": "tierkv",
    "module_path": "tierkv.integrations.sglang",
    "class_name": "TierkvHiCacheStorage",
    "interface_v1": 1,
}


def sglang() -> Any:
    try:
        from sglang.srt.mem_cache import hicache_storage
        from sglang.srt.mem_cache.storage import backend_factory
    except Exception as exc:
        missing_server("sglang 0.5.23 (bash scripts/setup-sglang.sh)", exc)
    return hicache_storage, backend_factory


def page_hashes(n: int, salt: str = "") -> list[str]:
    """Page hashes as SGLang makes them (hex sha256 strings)."""
    return [hashlib.sha256(f"{salt}page{i}".encode()).hexdigest() for i in range(n)]


def fill(pool: Any, pages: list[int], seed: str) -> None:
    """Distinct, checkable bytes in each of `pages` of `pool`."""
    import torch

    for page in pages:
        flat = pool.get_data_page(page * pool.page_size)
        digest = hashlib.blake2b(f"{seed}:{page}".encode(), digest_size=64).digest()
        raw = (digest * (flat.numel() * flat.element_size() // 64 + 1))[
            : flat.numel() * flat.element_size()
        ]
        pool.set_from_flat_data_page(
            page * pool.page_size, torch.frombuffer(bytearray(raw), dtype=pool.dtype)
        )


def make_pool(**kwargs: Any) -> Any:
    from tierkv.integrations.sglang.stand_in import HostPoolStandIn

    return HostPoolStandIn(**kwargs)


def build(
    pool: Any,
    tiers: list[dict[str, Any]],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    model: str = "org/tiny-model",
    **extra: Any,
) -> Any:
    """The backend as SGLang's cache controller builds it: the factory with the
    dynamic config, then the host pool, then `on_host_pools_registered`."""
    hicache_storage, backend_factory = sglang()
    config = hicache_storage.HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=pool.layout == "page_first",
        model_name=model,
        extra_config={**BACKEND, "tiers": tiers, **extra},
    )
    backend = backend_factory.StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


class Rig:
    """What a test needs: backends built as SGLang builds them (closed at the end),
    stand-in pools, page hashes, page bytes, tier sections, fault injection."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.made: list[Any] = []
        self.page_hashes = page_hashes
        self.fill = fill
        self.pool = make_pool

    def backend(self, *args: Any, **kwargs: Any) -> Any:
        backend = build(*args, **kwargs)
        self.made.append(backend)
        return backend

    def nvme(self, name: str = "nvme", **fields: Any) -> dict[str, Any]:
        return nvme(self.tmp_path / name, **fields)

    def close(self) -> None:
        for backend in self.made:
            backend.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    sglang()
    made = Rig(tmp_path)
    yield made
    made.close()


def nvme(path: Path, **fields: Any) -> dict[str, Any]:
    return {"type": "nvme", "path": str(path), "capacity": "256MiB", **fields}


@pytest.fixture(scope="session")
def real_pools() -> Any:
    """`real_pools.py`: SGLang's own host pool classes, built on CPU (imported once)."""
    sglang()
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tierkv_test_real_pools", Path(__file__).with_name("real_pools.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Any]:
    """A real redis-server the test may stop, restart, freeze and thaw."""
    try:
        from tierkv_redis.testing import RedisServer

        (tmp_path / "redis").mkdir()
        server = RedisServer(tmp_path / "redis")
    except Exception as exc:  # tierkv-cache-redis or redis-server missing
        missing_server("tierkv-cache-redis and a redis-server", exc)
    with server:
        yield server
