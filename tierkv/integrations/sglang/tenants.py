"""The tenant of an SGLang storage call, from its `HiCacheStorageExtraInfo`.

SGLang (0.5.23) passes an L3 backend a `HiCacheStorageExtraInfo(prefix_keys,
extra_info)` with each call, and its cache controllers leave `extra_info` empty: a
request's `cache_salt`, `extra_key` and LoRA id are folded into its page hashes
upstream (so tenants' pages stay apart) and none reaches a backend. So under stock
SGLang every call is the default tenant. A controller that fills `extra_info` (a fork,
a later SGLang) is read: its `tenant` as a name, else its `cache_salt` by its digest
(`tierkv.contract.tenants.salt_tenant`), never the salt itself.
"""

from __future__ import annotations

from typing import Any

from tierkv.contract.tenants import salt_tenant


def tenant_of(extra_info: Any) -> str | None:
    """The tenant an SGLang call's `extra_info` names; None (the default) when none."""
    info = getattr(extra_info, "extra_info", None)
    if not info or not isinstance(info, dict):
        return None
    tenant = info.get("tenant")
    if isinstance(tenant, str) and tenant:
        return tenant
    salt = info.get("cache_salt")
    return salt_tenant(salt) if isinstance(salt, (str, bytes)) else None
