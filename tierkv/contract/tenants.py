"""Tenants: who a request serves, named so that a report may show it.

A request carries its tenant in `ReqContext.tenant`: a name an embedding server
gives, or one an engine adapter derives from what its engine knows (vLLM's
`cache_salt` or LoRA name, LMCache's `cache_salt`). A cache salt is a secret-ish
value (knowing it lets a client share another's cached prefixes), so it never becomes
a name itself: `salt_tenant` names it by a short digest, stable across processes and
machines, which is what metrics, stats and logs show.
"""

from __future__ import annotations

import hashlib

__all__ = ["DEFAULT_TENANT", "OTHER_TENANTS", "salt_tenant"]

DEFAULT_TENANT = "default"
"""How reports name requests that carry no tenant (`ReqContext.tenant` None). A
tenant given this name is the default tenant."""

OTHER_TENANTS = "other"
"""How reports name the tenants past the largest few, summed (a tenant given this
name is always summed there)."""

_PERSON = b"tierkv-tenant"


def salt_tenant(salt: str | bytes | None) -> str | None:
    """The tenant name of a cache salt: `salt-` and the first 8 hex digits of its
    BLAKE2b digest (personalised for tierkv, so the name is no digest another tool
    publishes); None for no salt (None or empty): the default tenant.

    Eight hex digits tell 65,536 tenants apart with a chance of one collision below
    40%: accounting, not isolation (the salted keys keep tenants apart). The digest
    is unkeyed, so a salt with little entropy can be guessed from its name: salts
    should be random (an API key's hash, a UUID)."""
    if not salt:
        return None
    data = salt.encode() if isinstance(salt, str) else bytes(salt)
    return "salt-" + hashlib.blake2b(data, digest_size=4, person=_PERSON).hexdigest()
