"""The tenant of a vLLM request: its `cache_salt` or its LoRA adapter's name.

vLLM (0.33) hands a secondary tier a `ReqContext` (`vllm.v1.kv_offload.base`) built
from the scheduler's `Request` by its offloading connector
(`offloading/scheduler.py: _create_req_context`): the request id, its
`kv_transfer_params`, its KV hints and a tier filter, but neither the `cache_salt` nor
the `lora_request` the `Request` carries. So `install_hook` wraps that function once
per process (the scheduler's, where the tiers are built): each context it makes also
carries a `RequestTenant` with the two, in the per-request state vLLM's `ReqContext`
keeps for tiers (`set_state`). Where the function is missing (another vLLM), every
request is the default tenant, and the adapter says so once.

A salt becomes a tenant by its digest (`tierkv.contract.tenants.salt_tenant`), never
itself; a LoRA name (an operator's adapter name, which vLLM's own metrics show) is
the tenant's name as it is.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierkv.contract.tenants import salt_tenant

logger = logging.getLogger(__name__)

SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
"""The module whose `_create_req_context` builds a request's offloading context."""

_MARK = "__tierkv_tenant_hook__"


@dataclass(frozen=True)
class RequestTenant:
    """What a vLLM request says about its tenant, kept on its offloading context."""

    cache_salt: str | None = None
    lora_name: str | None = None

    @classmethod
    def of(cls, request: Any) -> RequestTenant:
        """Read from vLLM's `Request` (`cache_salt`, `lora_request.lora_name`)."""
        lora = getattr(request, "lora_request", None)
        return cls(
            getattr(request, "cache_salt", None) or None,
            getattr(lora, "lora_name", None) or None,
        )


def install_hook() -> bool:
    """Make vLLM's offloading contexts carry their request's `RequestTenant`
    (idempotent). False where this vLLM builds them some other way."""
    try:
        module = importlib.import_module(SCHEDULER)
    except ImportError:
        return False
    make = getattr(module, "_create_req_context", None)
    if not callable(make):
        return False
    if getattr(make, _MARK, False):
        return True
    module._create_req_context = _wrap(make)  # type: ignore[attr-defined]
    return True


def _wrap(make: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(make)
    def create_req_context(request: Any) -> Any:
        ctx = make(request)
        try:
            ctx.set_state(RequestTenant.of(request))
        except Exception:  # never in the way of a request: it is the default tenant
            logger.debug("tierkv: could not note the tenant of a vLLM request", exc_info=True)
        return ctx

    setattr(create_req_context, _MARK, True)
    return create_req_context


def tenant_of(req_context: Any, source: str) -> str | None:
    """The tenant of a vLLM `ReqContext` by `source` (`cache_salt`, `lora`, `none`):
    None (the default tenant) when the request has none or the context says nothing.
    A field vLLM's context may carry itself one day is read first."""
    if source == "none":
        return None
    noted = _noted(req_context)
    if source == "cache_salt":
        salt = getattr(req_context, "cache_salt", None) or (noted and noted.cache_salt)
        return salt_tenant(salt) if salt else None
    name = getattr(req_context, "lora_name", None) or (noted and noted.lora_name)
    return str(name) if name else None


def _noted(req_context: Any) -> RequestTenant | None:
    get_state = getattr(req_context, "get_state", None)
    if get_state is None:
        return None
    noted = get_state(RequestTenant)
    return noted if isinstance(noted, RequestTenant) else None
