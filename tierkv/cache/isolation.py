"""Tenant isolation (`tenants.isolate`): each tenant's blocks under keys of its own.

Tiers store by key, so two tenants whose requests hash to the same key share one block,
and a tenant whose lookup hits (or whose load comes back fast) learns that someone sent
that prefix before. With `isolate: true` the cache keeps tenants apart at its own door:
every key a tenant other than the default passes to `lookup`, `load`, `store` or
`prefetch` becomes that tenant's key (`tenant_keys`): a BLAKE2b of the key, keyed by
the tenant, as long as the block hash it replaces, followed by the key's own four
group bytes (retention reads the group from a key; a tier's frame size follows the
key's length). The primary, the index, the claims and every tier see only those keys,
so nothing below the facade knows of tenants, and a tier several servers share keeps
tenants apart on all of them (a tenant's key is the same everywhere). The default
tenant's keys go through as they are: a cache whose requests carry no tenant stores
and finds what it did before, and its calls do no per-block work; with
`isolate: false` no call does.

What goes back to the caller is in its own keys: a call's results through the map
that call made (`TenantCall`), a `Prefetch` through a view (`TenantPrefetch`), events
through `EventNames`: tenant key -> caller key for every key an isolated tenant
stored, loaded or prefetched, the most recently used last, bounded like the key index.
An event names the caller's key (what an engine maps back to its block hash), not the
tenant: two tenants' copies of one prefix give two `stored` events for the same key,
and one `removed` event when either copy leaves; the stream tells a router that some
tenant hits there, never whose prompt it was. A key whose name was forgotten (a tier
evicting a block nobody stored or read for longer than the map remembers) goes out as
the tenant key, which names no block the engine knows: a router ignores it, or keeps a
hint that never matches.

The derivation is public (tenant name and key in, no secret), so it is the hash chain
that keeps the default tenant, whose keys go through as given, from another tenant's
blocks: naming one from tokens takes a prefix whose chain ends at that tenant's key, a
preimage. A server whose clients pass keys of their own gives every such client a
tenant. Isolation is as strong as keys are long: 16-byte block hashes or more.

The engine adapters drive tiers with their engine's keys and never pass through here;
they need not: vLLM mixes a request's `cache_salt` and LoRA adapter into its block
hashes and LMCache its `cache_salt` into its object keys, the only things those
adapters name tenants by, so two tenants there never share a key. SGLang's adapter
may name a tenant its page hashes know nothing of, and refuses `isolate: true`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from itertools import islice
from types import MappingProxyType
from typing import Any, NoReturn

from tierkv.cache.prefetch import Prefetch
from tierkv.cache.results import LoadResult, LookupResult, StoreResult
from tierkv.contract.events import OffloadingEvent
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.tenants import DEFAULT_TENANT

__all__ = ["EventNames", "Isolation", "TenantCall", "TenantPrefetch", "tenant_keys"]

_PERSON = b"tierkv-isolation"  # BLAKE2b's personalisation: no other use makes these digests
_GROUP = 4  # the group bytes at the end of a key, kept as they are
_MAX_DIGEST = 64  # BLAKE2b's longest digest; a longer block hash takes SHAKE256's


def is_default(tenant: str | None) -> bool:
    """Whether `tenant` is the default tenant (None, empty or `default`)."""
    return not tenant or tenant == DEFAULT_TENANT


def _tenant_secret(tenant: str) -> bytes:
    """The BLAKE2b key of `tenant` (a name of any length fits BLAKE2b's 64-byte key)."""
    data = tenant.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=32, person=_PERSON).digest()


def _hasher(secret: bytes, n: int) -> Any:
    """The keyed BLAKE2b of `n`-byte digests, its key block hashed: copied per key."""
    return hashlib.blake2b(digest_size=n, key=secret, person=_PERSON)


def _one_key(secret: bytes, key: Any) -> Any:
    """The tenant key of one value of any shape (a value that is not an offload key is
    passed as it is, for the call's checks to refuse)."""
    if type(key) is not bytes or len(key) <= _GROUP:
        return key
    n = len(key) - _GROUP
    if n > _MAX_DIGEST:
        digest = hashlib.shake_256(_PERSON + secret + key).digest(n)
    else:
        h = _hasher(secret, n)
        h.update(key)
        digest = h.digest()
    return digest + key[-_GROUP:]


def tenant_keys(tenant: str, keys: Sequence[Any]) -> list[Any]:
    """The cache's keys for `tenant`'s `keys`, in order: BLAKE2b(key) keyed by the
    tenant, as long as the block hash, then the key's group bytes. The common case
    (offload keys of one length) hashes the key block once per call and copies it per
    key; anything else goes key by key."""
    secret = _tenant_secret(tenant)
    if keys and set(map(type, keys)) == {bytes}:
        sizes = set(map(len, keys))
        size = sizes.pop()
        if not sizes and _GROUP < size <= _GROUP + _MAX_DIGEST:
            copy = _hasher(secret, size - _GROUP).copy
            out: list[Any] = []
            append = out.append
            for key in keys:
                h = copy()
                h.update(key)
                append(h.digest() + key[-_GROUP:])
            return out
    return [_one_key(secret, key) for key in keys]


class EventNames:
    """Tenant key -> the caller's key, for naming events back (module docstring).

    Holds at most `limit` keys: the most recently stored, loaded or prefetched; past
    that the least recently used eighth is forgotten at once."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._names: dict[OffloadKey, OffloadKey] = {}

    def __len__(self) -> int:
        return len(self._names)

    def remember(self, ours: Sequence[Any], theirs: Sequence[Any]) -> None:
        names = self._names
        for key in ours:  # used again: to the end, the last to be forgotten
            names.pop(key, None)
        names.update(zip(ours, theirs))
        excess = len(names) - self.limit
        if excess > 0:
            for key in list(islice(names, excess + self.limit // 8)):
                del names[key]

    def name(self, events: list[OffloadingEvent]) -> list[OffloadingEvent]:
        """`events` with every tenant key the map knows named back."""
        names = self._names
        if not names:
            return events
        named = []
        for event in events:
            keys = tuple([names.get(k, k) for k in event.keys])
            named.append(event if keys == event.keys else replace(event, keys=keys))
        return named


class TenantCall:
    """One call of an isolated tenant: its keys in as the tenant's, and what the cache
    hands back out in its own keys again (through the map this call made)."""

    def __init__(self, tenant: str, names: EventNames) -> None:
        self.tenant = tenant
        self._names = names
        self.back: dict[OffloadKey, OffloadKey] = {}

    # -- in --------------------------------------------------------------------------
    def keys(self, keys: Sequence[OffloadKey], *, remember: bool = True) -> list[OffloadKey]:
        """The tenant's keys for `keys`; with `remember`, kept to name events back (a
        call that may place blocks: store, load, prefetch)."""
        if isinstance(keys, bytes | str):
            return keys  # not keys: the call refuses it
        keys = list(keys)
        if keys and set(map(type, keys)) != {bytes}:
            return keys  # not all keys: the call refuses them, as for any tenant
        ours = tenant_keys(self.tenant, keys)
        self.back.update(zip(ours, keys))
        if remember:
            self._names.remember(ours, keys)
        return ours

    def groups(
        self, keys_per_group: Sequence[Sequence[OffloadKey]], *, remember: bool = False
    ) -> list[list[OffloadKey]]:
        """`keys` for each group (anything not a group of keys as it is)."""
        if isinstance(keys_per_group, bytes | str):
            return keys_per_group  # not groups: the call refuses it
        return [
            self.keys(ks, remember=remember) if isinstance(ks, Sequence) else ks
            for ks in keys_per_group
        ]

    def source(
        self, source: Sequence[Sequence[OffloadKey]] | LookupResult
    ) -> Sequence[Sequence[OffloadKey]] | LookupResult:
        """A prefetch's source in the tenant's keys (a `LookupResult` this cache handed
        back in the caller's keys becomes one in the tenant's)."""
        if not isinstance(source, LookupResult):
            return self.groups(source, remember=True)
        group_keys = tuple(tuple(self.keys(ks)) for ks in source.group_keys)
        ours = dict(zip(source.keys_to_load, (k for ks in group_keys for k in ks)))
        locations = {ours.get(k, k): m for k, m in source.locations.items()}
        return replace(source, group_keys=group_keys, locations=MappingProxyType(locations))

    # -- out -------------------------------------------------------------------------
    def _theirs(self, keys: Sequence[OffloadKey]) -> tuple[OffloadKey, ...]:
        back = self.back
        return tuple([back.get(k, k) for k in keys])

    def _map(self, mapping: Mapping[OffloadKey, Any]) -> Mapping[OffloadKey, Any]:
        back = self.back
        return MappingProxyType({back.get(k, k): v for k, v in mapping.items()})

    def lookup_result(self, result: LookupResult) -> LookupResult:
        return replace(
            result,
            group_keys=tuple(self._theirs(ks) for ks in result.group_keys),
            locations=self._map(result.locations),
        )

    def store_result(self, result: StoreResult) -> StoreResult:
        return replace(
            result,
            stored=self._theirs(result.stored),
            already_present=self._theirs(result.already_present),
            rejected=self._theirs(result.rejected),
            skipped=self._theirs(result.skipped),
        )

    def load_result(self, result: LoadResult) -> LoadResult:
        return replace(
            result,
            ok_keys=self._theirs(result.ok_keys),
            failed_keys=self._theirs(result.failed_keys),
            errors=self._map(result.errors),
            sources=self._map(result.sources),
        )

    def prefetch(self, prefetch: Prefetch) -> Prefetch:
        return TenantPrefetch(prefetch, self.back)


def _read_only(name: str) -> NoReturn:
    raise AttributeError(f"a tenant's view of a prefetch is read-only ({name})")


class TenantPrefetch(Prefetch):
    """An isolated tenant's `Prefetch`, in its own keys: the prefetch itself runs (and
    is held by the cache) under the tenant's keys; this view names its key lists back
    when read, and delegates everything else to it."""

    def __init__(self, inner: Prefetch, back: Mapping[OffloadKey, OffloadKey]) -> None:
        # no Prefetch.__init__: the state is the inner prefetch's (`__getattr__`)
        self._inner = inner
        self._back = back

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)

    def _theirs(self, keys: Any) -> list[OffloadKey]:
        back = self._back
        return [back.get(k, k) for k in keys]

    @property
    def promoted(self) -> list[OffloadKey]:
        return self._theirs(self._inner.promoted)

    @promoted.setter
    def promoted(self, value: list[OffloadKey]) -> None:
        _read_only("promoted")

    @property
    def held(self) -> set[OffloadKey]:
        return set(self._theirs(self._inner.held))

    @held.setter
    def held(self, value: set[OffloadKey]) -> None:
        _read_only("held")

    @property
    def shed(self) -> list[OffloadKey]:
        return self._theirs(self._inner.shed)

    @shed.setter
    def shed(self, value: list[OffloadKey]) -> None:
        _read_only("shed")

    @property
    def failed(self) -> dict[OffloadKey, str]:
        back = self._back
        return {back.get(k, k): why for k, why in self._inner.failed.items()}

    @failed.setter
    def failed(self, value: dict[OffloadKey, str]) -> None:
        _read_only("failed")

    def cancel(self) -> None:
        self._inner.cancel()


class Isolation:
    """A cache's tenant isolation: who gets keys of their own, and the names that turn
    events back into callers' keys."""

    def __init__(self, names: int) -> None:
        self.names = EventNames(names)

    def call(self, ctx: ReqContext | None) -> TenantCall | None:
        """The call of `ctx`'s tenant; None for the default tenant (keys as given)."""
        tenant = ctx.tenant if ctx is not None else None
        return None if tenant is None or is_default(tenant) else TenantCall(tenant, self.names)

    def events(self, events: list[OffloadingEvent]) -> list[OffloadingEvent]:
        return self.names.name(events)
