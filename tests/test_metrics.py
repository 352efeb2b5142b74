"""Prometheus metrics from `TieredCache.stats()`, scraped over HTTP on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.keys import hash_token_blocks, make_offload_key
from tierkv.metrics import TieredCacheCollector, serve_metrics

pytestmark = pytest.mark.anyio

CHAIN = """
namespace: metrics-test
layout: {block_bytes: 4KiB, groups: [{block_size: 16}]}
primary: {capacity: 16KiB, pin_memory: false}
tiers: [{type: memory, capacity: 1MiB}]
"""


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


async def test_scrape_finds_tier_series_over_http() -> None:
    keys = [
        make_offload_key(h, 0)
        for h in hash_token_blocks(list(range(16 * 8)), 16, namespace="metrics-test")
    ]
    async with TieredCache(parse_config(CHAIN)) as cache:
        for start in range(0, 8, 2):  # 8 blocks through a 4-block primary
            await cache.store(keys[start : start + 2], torch.zeros(2, 4096, dtype=torch.uint8))
            await cache.flush()
        hit = await cache.lookup([keys])
        await cache.load(
            hit.keys_to_load, torch.empty(len(hit.keys_to_load), 4096, dtype=torch.uint8)
        )
        async with serve_metrics(cache, port=0) as server:
            assert server.port > 0 and server.url.endswith("/metrics")
            status, text = await anyio.to_thread.run_sync(get, server.url)
            missing, _ = await anyio.to_thread.run_sync(get, server.url.replace("/metrics", "/x"))
    assert status == 200 and missing == 404
    got = samples(text)
    ns = ("namespace", "metrics-test")

    def value(name: str, **labels: str) -> float:
        return got[(name, frozenset({ns, *labels.items()}))]

    assert value("tierkv_stored_blocks_total", tier="memory") == 8
    assert value("tierkv_stored_bytes_total", tier="memory") == 8 * 4096
    assert value("tierkv_loaded_blocks_total", tier="memory") >= 1
    assert value("tierkv_hits_total", tier="cpu") >= 1
    assert value("tierkv_lookups_total", tier="memory") == 1
    assert value("tierkv_breaker_state", tier="memory", state="closed") == 1
    assert value("tierkv_breaker_state", tier="memory", state="open") == 0
    assert value("tierkv_job_latency_seconds_count", tier="memory") >= 5
    assert value("tierkv_job_latency_seconds", tier="memory", quantile="0.99") > 0
    assert value("tierkv_primary_blocks", state="blocks") == 4
    assert value("tierkv_dropped_blocks_total", tier="memory") == 0


def test_collector_takes_any_stats_source() -> None:
    from tierkv.cache import CacheStats

    stats = CacheStats({"hits": 3, "blocks": 2}, {"nvme": {"errors": 1, "breaker": "open"}})
    families = {f.name: f for f in TieredCacheCollector(lambda: stats, namespace="n").collect()}
    errors = {s.labels["tier"]: s.value for s in families["tierkv_errors"].samples}
    assert errors == {"nvme": 1}
    states = {s.labels["state"]: s.value for s in families["tierkv_breaker_state"].samples}
    assert states == {"closed": 0, "open": 1, "half_open": 0}


def test_each_side_of_a_tier_has_its_breaker_series() -> None:
    """A full disk: writes open, reads closed; the series say the tier still serves
    reads, which the combined `tierkv_breaker_state` (the worse side) cannot."""
    from tierkv.cache import CacheStats

    nvme = {"breaker": "open", "read_breaker": "closed", "write_breaker": "open"}
    stats = CacheStats({}, {"nvme": nvme})
    families = {f.name: f for f in TieredCacheCollector(lambda: stats, namespace="n").collect()}
    on = {
        (s.labels["side"], s.labels["state"])
        for s in families["tierkv_breaker_side_state"].samples
        if s.value == 1
    }
    assert on == {("reads", "closed"), ("writes", "open")}


def test_a_tiers_data_path_is_a_series() -> None:
    from tierkv.cache import CacheStats

    stats = CacheStats({}, {"nvme": {"data_path": "native"}, "redis": {"data_path": None}})
    families = {f.name: f for f in TieredCacheCollector(lambda: stats, namespace="n").collect()}
    got = {(s.labels["tier"], s.labels["path"]) for s in families["tierkv_data_path"].samples}
    assert got == {("nvme", "native")}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_demo_serves_metrics_while_it_runs(tmp_path: Path) -> None:
    port = free_port()
    cmd = [
        sys.executable, "-m", "tierkv.cli", "demo", "--json", "--users", "2", "--turns", "2",
        "--system-tokens", "64", "--message-tokens", "32", "--reply-tokens", "2",
        "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "256",
        "--metrics-port", str(port), "--linger", "60",
    ]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status, text = get(f"http://127.0.0.1:{port}/metrics")
            except OSError:
                status = 0
            # the run is over once the nvme tier has written the last turn's blocks
            if status == 200 and "tierkv_stored_blocks_total{namespace" in text:
                got = samples(text)
                stored = [
                    v
                    for (n, labels), v in got.items()
                    if n == "tierkv_stored_blocks_total" and ("tier", "nvme") in labels
                ]
                if stored and stored[0] > 0:
                    break
            time.sleep(0.2)
        else:
            pytest.fail(f"no nvme series scraped; demo said {proc.communicate()[1].decode()}")
    finally:
        proc.send_signal(signal.SIGINT)  # ends the linger; the demo cleans up and exits
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err.decode()
    assert "tierkv_loaded_bytes_total" in text and 'tier="cpu"' in text
    assert list(tmp_path.iterdir()) == []  # the default chain's temp directory is gone


async def test_cache_wide_counters_follow_stats() -> None:
    """The cache's own counters (not per tier) are exported with their stats values:
    a store larger than a primary with no tier below rejects the rest, and a scrape
    shows exactly the count the StoreResult gave."""
    chain = """
namespace: metrics-cache
layout: {block_bytes: 4KiB, groups: [{block_size: 16}]}
primary: {capacity: 16KiB, pin_memory: false}
tiers: []
"""
    keys = [
        make_offload_key(h, 0)
        for h in hash_token_blocks(list(range(16 * 6)), 16, namespace="metrics-cache")
    ]
    async with TieredCache(parse_config(chain)) as cache:
        result = await cache.store(keys, torch.zeros(6, 4096, dtype=torch.uint8))
        stats = cache.stats().primary
        got = samples(generate(cache))
    ns = frozenset({("namespace", "metrics-cache")})
    assert len(result.rejected) == 2  # 4 blocks fit, no tier to stream the rest to
    assert got[("tierkv_store_rejected_blocks_total", ns)] == 2
    for field, name in (
        ("store_rejected", "tierkv_store_rejected_blocks_total"),
        ("store_waits", "tierkv_store_waits_total"),
        ("write_back_dropped", "tierkv_write_back_dropped_blocks_total"),
        ("promotions_shed", "tierkv_promotions_shed_blocks_total"),
        ("events_dropped", "tierkv_events_dropped_total"),
        ("background_jobs", "tierkv_background_jobs"),
        ("indexed_keys", "tierkv_indexed_keys"),
        ("pinned_bytes", "tierkv_primary_pinned_bytes"),
    ):
        assert got[(name, ns)] == stats[field], name


def test_every_cache_wide_stat_is_exported() -> None:
    """A counter the cache adds to stats().primary gets a series, or is an occupancy
    state of tierkv_primary_blocks, or a per-medium field: none is left unexported."""
    from tierkv.metrics import CACHE_COUNTERS, CACHE_GAUGES, COUNTERS, GAUGES, PRIMARY_GAUGES

    async def primary_fields() -> set[str]:
        async with TieredCache(parse_config(CHAIN)) as cache:
            return set(cache.stats().primary)

    fields = anyio.run(primary_fields)
    exported = {*CACHE_COUNTERS, *CACHE_GAUGES, *COUNTERS, *GAUGES, *PRIMARY_GAUGES}
    per_medium_extras = {  # not for the primary
        "breaker",
        "read_breaker",
        "write_breaker",
        "serving",
        "data_path",
        "job_latency",
        "lookup_latency",
    }
    assert fields - exported - per_medium_extras == set()


def test_cache_wide_series_have_help_text() -> None:
    from tierkv.cache import CacheStats

    stats = CacheStats({"store_waits": 3, "indexed_keys": 7}, {})
    families = {f.name: f for f in TieredCacheCollector(lambda: stats, namespace="n").collect()}
    assert families["tierkv_store_waits"].type == "counter"
    assert families["tierkv_store_waits"].documentation.startswith("Times a store waited")
    assert families["tierkv_indexed_keys"].type == "gauge"
    assert [s.value for s in families["tierkv_indexed_keys"].samples] == [7]
    assert "tierkv_promotions_shed_blocks" not in families  # absent from stats: no series


def generate(cache: TieredCache) -> str:
    from prometheus_client import generate_latest

    from tierkv.metrics import registry_for

    return generate_latest(registry_for(cache)).decode()


def test_every_cache_wide_metric_is_documented_in_the_manual() -> None:
    """A metric an operator sees on a dashboard has a row in the manual's table."""
    section = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    from tierkv.metrics import CACHE_COUNTERS, CACHE_GAUGES, PREFIX

    names = [f"`{PREFIX}_{name}_total`" for name, _ in CACHE_COUNTERS.values()]
    names += [f"`{PREFIX}_{name}`" for name, _ in CACHE_GAUGES.values()]
    missing = [name for name in names if name not in section]
    assert not missing, f"not in the Metrics table of docs/metrics.md: {missing}"


async def test_per_tenant_series_over_http_capped_at_report_top() -> None:
    """50 tenants through one cache with `report_top: 5`: the scrape names the 5 that
    moved the most blocks and sums the other 45 as `other`, and no label holds a salt."""
    from tierkv.contract.jobs import ReqContext
    from tierkv.contract.tenants import salt_tenant

    chain = """
namespace: metrics-tenants
layout: {block_bytes: 4KiB, groups: [{block_size: 16}]}
primary: {capacity: 64KiB, pin_memory: false}
tiers: []
tenants: {report_top: 5}
"""
    salts = [f"secret-salt-{i:02d}" for i in range(50)]
    async with TieredCache(parse_config(chain)) as cache:
        for i, salt in enumerate(salts):
            n = 1 + (i % 10 == 9)  # every tenth stores 2 blocks: 5 big tenants
            ks = [
                make_offload_key(h, 0)
                for h in hash_token_blocks(list(range(16 * n)), 16, namespace=salt)
            ]
            ctx = ReqContext(f"r{i}", tenant=salt_tenant(salt))
            await cache.store(ks, torch.zeros(n, 4096, dtype=torch.uint8), ctx=ctx)
            await cache.lookup([ks], ctx)
        async with serve_metrics(cache, port=0) as server:
            status, text = await anyio.to_thread.run_sync(get, server.url)
    assert status == 200
    assert not any(salt in text for salt in salts)
    stored = {
        dict(labels)["tenant"]: value
        for (name, labels), value in samples(text).items()
        if name == "tierkv_tenant_stored_blocks_total"
    }
    big = {salt_tenant(salts[i]) for i in range(9, 50, 10)}
    assert set(stored) == {*big, "other"}
    assert all(stored[t] == 2 for t in big)
    assert stored["other"] == 45
    hits = {
        dict(labels)["tenant"]
        for (name, labels), _ in samples(text).items()
        if name == "tierkv_tenant_hits_total"
    }
    assert hits == set(stored)  # every tenant family has the same bounded labels


def test_tenant_series_follow_stats_tenants() -> None:
    from tierkv.cache import CacheStats

    row = {"hits": 3, "misses": 1, "stored_bytes": 8192, "primary_bytes": 4096}
    stats = CacheStats({}, {}, {"acme": row, "default": {"hits": 2}})
    families = {f.name: f for f in TieredCacheCollector(lambda: stats, namespace="n").collect()}
    hits = {s.labels["tenant"]: s.value for s in families["tierkv_tenant_hits"].samples}
    assert hits == {"acme": 3, "default": 2}
    assert families["tierkv_tenant_hits"].type == "counter"
    assert families["tierkv_tenant_primary_bytes"].type == "gauge"
    assert [s.value for s in families["tierkv_tenant_primary_bytes"].samples] == [4096]
    no_tenants = CacheStats({}, {})
    names = {f.name for f in TieredCacheCollector(lambda: no_tenants).collect()}
    assert not any(name.startswith("tierkv_tenant_") for name in names)


def test_every_tenant_field_is_exported_and_documented() -> None:
    from tierkv.cache.tenants import TenantLedger
    from tierkv.metrics import PREFIX, TENANT_COUNTERS, TENANT_GAUGES

    ledger = TenantLedger(4096)
    ledger.stored("t", 1, 0)
    row = ledger.report(resident=0)["t"]
    assert set(row) - {*TENANT_COUNTERS, *TENANT_GAUGES} == {"primary_blocks"}
    section = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    names = [f"`{PREFIX}_{name}_total`" for name, _ in TENANT_COUNTERS.values()]
    names += [f"`{PREFIX}_{name}`" for name, _ in TENANT_GAUGES.values()]
    missing = [name for name in names if name not in section]
    assert not missing, f"not in docs/metrics.md: {missing}"
