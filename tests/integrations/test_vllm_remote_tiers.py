"""Blocks stored by one vLLM engine and promoted by another, through vLLM's real
tiering manager: over a real redis-server, moto's S3 server, and an nvme directory
handed from one process to the next."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HERE = Path(__file__).parent


def store_then_promote(vllm: Any, tier: dict[str, Any], n: int = 6) -> None:
    keys = vllm.keys(n, uuid.uuid4().hex)
    writer = vllm.engine([vllm.entry(tier)])
    ctx = writer.new_request()
    writer.store(ctx, keys)
    writer.finish(ctx)
    writer.settle()
    writer.shutdown()

    reader = vllm.engine([vllm.entry(tier)])  # another engine: its primary is empty
    ctx = reader.new_request()
    assert reader.promote(ctx, keys) == n
    assert reader.read(ctx, keys) == [vllm.payload(k) for k in keys]


def test_redis_tier_under_vllm(vllm: Any, redis_url: str) -> None:
    store_then_promote(vllm, {"type": "redis", "url": redis_url})


def test_s3_tier_under_vllm(vllm: Any, moto_server: Any) -> None:
    moto_server.create_bucket("vllm-remote")
    store_then_promote(
        vllm,
        {
            "type": "s3",
            "url": f"s3://vllm-remote/{uuid.uuid4().hex}",
            "endpoint_url": moto_server.endpoint_url,
            "access_key_id": "testing",
            "secret_access_key": "testing",
            "region": "us-east-1",
        },
    )


CHILD = """
import sys
sys.path.insert(0, {here!r})
from conftest import Engine, make_keys

engine = Engine([{{"type": "tierkv", "tier": {tier!r}}}])
keys = make_keys({n}, {salt!r})
ctx = engine.new_request()
engine.store(ctx, keys)
engine.finish(ctx)
engine.settle()
engine.shutdown()
print("stored", len(keys))
"""


def run_child(tier: dict[str, Any], n: int, salt: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(CHILD).format(here=str(HERE), tier=tier, n=n, salt=salt)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )


def test_nvme_directory_shared_by_two_processes(vllm: Any, tmp_path: Path) -> None:
    tier = {"type": "nvme", "path": str(tmp_path / "kv"), "capacity": "4MiB"}
    child = run_child(tier, 5, "two-processes")
    assert child.returncode == 0, child.stderr[-3000:]
    assert "stored 5" in child.stdout

    engine = vllm.engine([vllm.entry(tier)])  # this process, the same directory
    keys = vllm.keys(5, "two-processes")
    ctx = engine.new_request()
    assert engine.promote(ctx, keys) == 5
    assert engine.read(ctx, keys) == [vllm.payload(k) for k in keys]

    # while this process holds the directory, a second one is told so, clearly
    busy = run_child(tier, 1, "second")
    assert busy.returncode != 0
    assert "is in use by another tier" in busy.stderr
