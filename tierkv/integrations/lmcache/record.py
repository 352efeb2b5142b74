"""`KeyRecord`: which of LMCache's object keys the tiers hold, for listing and usage.

tierkv's tiers hold blocks under hashed keys (`keys.offload_key`): nothing in a tier
gives LMCache's `ObjectKey` back. The adapter therefore remembers, per key it stored
(or loaded), the `ObjectKey`, the object's size and which tiers of its chain hold it
(a bit per tier, set when a tier's store or load job moved the key, cleared when the
tier reports it removed). A key is **resident** while some tier holds it: it enters
the record when the first tier takes it and leaves when the last one lets it go (its
own eviction, a failed check, LMCache's `delete`).

What the record cannot see: keys an earlier process stored in a tier that survives a
restart (nvme) until this process stores or loads them again, and keys a tier drops
without reporting it (a Redis evicting under `maxmemory`, a bucket's lifecycle rule):
those stay recorded until LMCache deletes them or the bound pushes them out. The
record is bounded (`limit` keys): past it the oldest entries are forgotten (they stay
in the tiers, unlisted and uncounted) and counted in `dropped`.

Listing walks the record in the order keys entered it (a sequence number per entry),
so a cursor is the last number a page returned, tied to this record: a key resident
throughout a listing is listed exactly once, a key removed before its page is not, a
key that enters during the listing is listed on a later page. Thread-safe; imports
nothing of LMCache (keys are kept as given, read by attribute).
"""

from __future__ import annotations

import bisect
import re
import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tierkv.contract.keys import OffloadKey

__all__ = ["KeyRecord", "Page", "Resident"]

_CURSOR = re.compile(r"tkv1\.([0-9a-f]{8})\.([0-9]{1,19})")
_COMPACT_AT = 64
"""An order is compacted once it holds this many removed entries and more removed
than live ones (a page skips at most about as many removed entries as it lists)."""


@dataclass
class Resident:
    """One recorded key: LMCache's key, its object's bytes, the tiers holding it."""

    key: Any
    size: int
    tiers: int
    seq: int


@dataclass
class _Order:
    """Sequence numbers of entries, ascending; removed ones are skipped, then
    compacted away."""

    seqs: list[int] = field(default_factory=list)
    live: int = 0
    dead: int = 0


@dataclass(frozen=True)
class Page:
    entries: list[tuple[Any, int]]
    """(LMCache key, object bytes) per key, in record order."""
    cursor: str | None
    """Where the next page starts; None after the last."""


class KeyRecord:
    """The resident keys (see the module docstring); at most `limit` of them."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"a key record holds at least one key, not {limit}")
        self.limit = limit
        self.dropped = 0
        """Entries forgotten because the record was full (still in the tiers)."""
        self._entries: dict[OffloadKey, Resident] = {}
        self._by_seq: dict[int, OffloadKey] = {}  # insertion order is seq order
        self._all = _Order()
        self._models: dict[str, _Order] = {}
        self._next_seq = 1
        self._token = secrets.token_hex(4)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, okey: OffloadKey) -> bool:
        return okey in self._entries

    # -- changes -----------------------------------------------------------------------
    def held(
        self, tier_bit: int, items: Iterable[tuple[OffloadKey, Any, int]]
    ) -> tuple[list[tuple[Any, int]], list[tuple[Any, int]]]:
        """The tier of `tier_bit` holds each `(okey, key, size)`. Returns the keys new
        to the record and the keys it forgot to make room, each as `(key, size)` (a key
        added and forgotten in one call is in neither)."""
        added: dict[OffloadKey, tuple[Any, int]] = {}
        forgotten: list[tuple[Any, int]] = []
        with self._lock:
            for okey, key, size in items:
                entry = self._entries.get(okey)
                if entry is not None:
                    entry.tiers |= tier_bit
                    continue
                while len(self._entries) >= self.limit:
                    oldest_okey = next(iter(self._by_seq.values()))
                    was = self._pop(self._entries[oldest_okey])
                    if added.pop(oldest_okey, None) is None:
                        forgotten.append(was)
                    self.dropped += 1
                entry = Resident(key, size, tier_bit, self._next_seq)
                self._next_seq += 1
                self._entries[okey] = entry
                self._by_seq[entry.seq] = okey
                for order in (self._all, self._model(str(key.model_name))):
                    order.seqs.append(entry.seq)
                    order.live += 1
                added[okey] = (key, size)
        return list(added.values()), forgotten

    def let_go(self, tier_bit: int, okeys: Iterable[OffloadKey]) -> list[tuple[Any, int]]:
        """The tier of `tier_bit` no longer holds `okeys`; returns the keys no tier
        holds now (they left the record), as `(key, size)`."""
        gone: list[tuple[Any, int]] = []
        with self._lock:
            for okey in okeys:
                entry = self._entries.get(okey)
                if entry is None:
                    continue
                entry.tiers &= ~tier_bit
                if not entry.tiers:
                    gone.append(self._pop(entry))
        return gone

    def forget(self, okeys: Iterable[OffloadKey]) -> list[tuple[Any, int]]:
        """No tier holds `okeys` (deleted from every tier)."""
        return self.let_go(-1, okeys)

    def _pop(self, entry: Resident) -> tuple[Any, int]:
        okey = self._by_seq.pop(entry.seq)
        del self._entries[okey]
        model = str(entry.key.model_name)
        for name, order in ((None, self._all), (model, self._models[model])):
            order.live -= 1
            order.dead += 1
            if name is not None and order.live == 0:
                del self._models[name]
            elif order.dead >= _COMPACT_AT and order.dead > order.live:
                order.seqs = [s for s in order.seqs if s in self._by_seq]
                order.dead = 0
        return entry.key, entry.size

    def _model(self, name: str) -> _Order:
        order = self._models.get(name)
        if order is None:
            order = self._models[name] = _Order()
        return order

    # -- listing -----------------------------------------------------------------------
    def page(self, model_name: str | None, page_size: int, cursor: str | None) -> Page:
        """Up to `page_size` resident keys after `cursor` (of `model_name`'s only, when
        given). `ValueError` for a `page_size` below 1 or a cursor this record did not
        make."""
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        after = self._after(cursor)
        entries: list[tuple[Any, int]] = []
        with self._lock:
            order = self._all if model_name is None else self._models.get(model_name)
            if order is None:
                return Page(entries, None)
            seqs, by_seq = order.seqs, self._by_seq
            i = bisect.bisect_right(seqs, after)
            last = after
            while i < len(seqs):
                okey = by_seq.get(seqs[i])
                i += 1
                if okey is None:
                    continue
                if len(entries) == page_size:  # one more is resident: not the last page
                    return Page(entries, self._cursor(last))
                entry = self._entries[okey]
                entries.append((entry.key, entry.size))
                last = entry.seq
        return Page(entries, None)

    def _cursor(self, seq: int) -> str:
        return f"tkv1.{self._token}.{seq}"

    def _after(self, cursor: str | None) -> int:
        if cursor is None:
            return 0
        found = _CURSOR.fullmatch(cursor) if isinstance(cursor, str) else None
        if found is None:
            raise ValueError(f"malformed cursor {cursor!r}: pass next_page_token as given")
        if found.group(1) != self._token:
            raise ValueError(
                f"cursor {cursor!r} was made by another adapter (or before a restart): "
                "start the listing again without a cursor"
            )
        return int(found.group(2))
