"""Shared fixtures for the core tests."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierkv.registry import register_tier, unregister_tier
from tierkv.testing import FaultyTier, missing_server


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def faulty_tier_type() -> Iterator[str]:
    """Makes `type: faulty` (tierkv.testing.FaultyTier) available to configs."""
    register_tier(FaultyTier)
    yield "faulty"
    unregister_tier("faulty")


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A real redis-server on a free loopback port (persistence off), for this test."""
    try:
        from tierkv_redis.testing import RedisServer

        server = RedisServer(tmp_path)
    except Exception as exc:  # tierkv-cache-redis or redis-server missing
        missing_server("tierkv-cache-redis and a redis-server", exc)
    with server:
        yield server.url


@pytest.fixture(scope="module")
def moto_server() -> Iterator[Any]:
    """moto's S3 server on a free loopback port; tests create their buckets."""
    try:
        from tierkv_s3.testing import MotoServer

        server = MotoServer()
    except Exception as exc:  # tierkv-cache-s3 or moto missing
        missing_server("tierkv-cache-s3 and moto", exc)
    with server:
        yield server


ROOT = Path(__file__).resolve().parents[1]


def doc_section(page: str, heading: str) -> str:
    """`page` (README.md, docs/configure.md, ...) from `heading` on: the tests that run
    the snippets of the README and the manual read them from there."""
    text = (ROOT / page).read_text()
    return text[text.index(heading) :]


@pytest.fixture
def doc_block() -> Callable[..., str]:
    """`doc_block(page, heading, language="python")`: the first fenced block of
    `language` under `heading` in `page` (a path from the repository root)."""

    def block(page: str, heading: str, language: str = "python") -> str:
        match = re.search(rf"```{language}\n(.*?)```", doc_section(page, heading), re.S)
        assert match, f"no {language} block under {heading!r} in {page}"
        return match.group(1)

    return block


@pytest.fixture
def chain_file(tmp_path: Path) -> Callable[..., str]:
    """`chain_file(tiers, primary="1MiB", namespace="t")`: the path of a small chain
    (4KiB blocks, one group) written under `tmp_path`; `tiers` is a YAML flow list."""

    def write(tiers: str, *, primary: str = "1MiB", namespace: str = "t") -> str:
        path = tmp_path / "chain.yaml"
        path.write_text(
            f"namespace: {namespace}\nlayout: {{block_bytes: 4KiB, groups: [{{block_size: 16}}]}}\n"
            f"primary: {{capacity: {primary}, pin_memory: false}}\ntiers: {tiers}\n"
        )
        return str(path)

    return write
