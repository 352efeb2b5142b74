"""A vLLM request's tenant reaches the tierkv tier: its `cache_salt` (as a digest) or its
LoRA name, as the entry's `tenant_from` says, on the tier's lookups and jobs. The
requests are vLLM's real `Request`s, their contexts built by vLLM's offloading
connector's own `_create_req_context`, under vLLM's real tiering manager."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tierkv.contract.errors import ConfigError
from tierkv.contract.tenants import salt_tenant

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SALT = "tenant-secret-9d2e"


def faulty() -> dict[str, Any]:
    return {"type": "faulty", "capacity": "1MiB"}


def new_request(engine: Any, req_id: str, **fields: Any) -> Any:
    """A vLLM `Request` as the engine core makes it, its offloading context built the
    way vLLM's connector does (`_create_req_context`), announced to the manager."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request(req_id, list(range(32)), SamplingParams(max_tokens=1), None, **fields)
    ctx = scheduler._create_req_context(request)
    with engine.manager.lock:
        engine.manager.on_new_request(ctx)
    return ctx


def seen(engine: Any) -> list[tuple[str, str | None]]:
    return list(engine.tiers[0].tierkv_tier.tenants)


def test_the_cache_salt_arrives_as_its_digest_on_stores_and_lookups(
    vllm: Any, faulty_tier_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    engine = vllm.engine([vllm.entry(faulty())])
    ctx = new_request(engine, "salted", cache_salt=SALT)
    engine.store(ctx, vllm.keys(4, "salted"))
    engine.settle()
    absent = vllm.keys(2, "never-stored")
    assert engine.prefix(ctx, absent) == (0, True)  # the tier is asked: RETRY
    engine.settle(lambda: engine.prefix(ctx, absent) == (0, False))
    engine.finish(ctx)
    engine.settle()
    tenant = salt_tenant(SALT)
    assert ("store", tenant) in seen(engine)
    assert ("lookup", tenant) in seen(engine)
    assert {t for _, t in seen(engine)} == {tenant}
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("tierkv")]
    assert ours and not any(SALT in line for line in ours)


def test_a_request_without_a_salt_is_the_default_tenant(vllm: Any, faulty_tier_type: str) -> None:
    engine = vllm.engine([vllm.entry(faulty())])
    ctx = new_request(engine, "plain")
    engine.store(ctx, vllm.keys(2, "plain"))
    engine.finish(ctx)
    engine.settle()
    assert seen(engine) and {t for _, t in seen(engine)} == {None}


def test_tenant_from_lora_names_the_adapter(vllm: Any, faulty_tier_type: str) -> None:
    from vllm.lora.request import LoRARequest

    engine = vllm.engine([vllm.entry(faulty(), tenant_from="lora")])
    lora = LoRARequest("customer-a-adapter", 7, "/adapters/a")
    ctx = new_request(engine, "lora", lora_request=lora, cache_salt=SALT)
    engine.store(ctx, vllm.keys(2, "lora"))
    engine.finish(ctx)
    engine.settle()
    assert {t for _, t in seen(engine)} == {"customer-a-adapter"}


def test_tenant_from_none_counts_every_request_as_the_default(
    vllm: Any, faulty_tier_type: str
) -> None:
    engine = vllm.engine([vllm.entry(faulty(), tenant_from="none")])
    ctx = new_request(engine, "none", cache_salt=SALT)
    engine.store(ctx, vllm.keys(2, "none"))
    engine.finish(ctx)
    engine.settle()
    assert {t for _, t in seen(engine)} == {None}


def test_a_store_submitted_after_the_request_ended_keeps_its_tenant(
    vllm: Any, faulty_tier_type: str
) -> None:
    """vLLM may cascade a request's blocks after it finished: the tenant is read from
    the context the job carries."""
    engine = vllm.engine([vllm.entry(faulty())])
    ctx = new_request(engine, "late", cache_salt=SALT)
    adapter = engine.tiers[0]
    adapter._tenants.clear()  # as after on_request_finished
    engine.store(ctx, vllm.keys(2, "late"))
    engine.finish(ctx)
    engine.settle()
    assert {t for _, t in seen(engine)} == {salt_tenant(SALT)}


def test_tenant_from_is_checked() -> None:
    from tierkv.integrations.vllm.settings import VllmGeometry, resolve_entry

    geometry = VllmGeometry("m", "float16", (16,), 1, 16, 4096, {}, {})
    entry = {"tier": {"type": "memory", "capacity": "1MiB"}, "tenant_from": "api_key"}
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.tenant_from: 'api_key'"):
        resolve_entry(entry, geometry, where="secondary_tiers[0]")
    entry["tenant_from"] = "lora"
    assert resolve_entry(entry, geometry).tenant_from == "lora"
    del entry["tenant_from"]
    assert resolve_entry(entry, geometry).tenant_from == "cache_salt"
