"""LMCache's locks as tierkv claims: which lookup holds a lock on each key.

`submit_lookup_and_lock_task` locks every key it finds; `submit_unlock(keys)` lets go
of one lock on each (LMCache unlocks what it looked up once the load is done or
given up, and never retries). A lookup's claims live in the tier chains under an
owner named after its task (`tierkv.driver.claims.ClaimLedger`, on the loop thread);
`LockBook` remembers, per key, the owners holding it, oldest first, so an unlock
ends the oldest lock of the key. A lock is never held for ever: the tier's claim
lease ends it, and the book forgets entries older than that lease.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from tierkv.contract.keys import OffloadKey

__all__ = ["LockBook"]


class LockBook:
    """Owners holding a lock per key, oldest first; thread-safe."""

    def __init__(self, lease: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease = lease
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[OffloadKey, deque[tuple[float, str]]] = {}
        self._order: deque[tuple[float, OffloadKey]] = deque()  # to forget expired ones

    def __len__(self) -> int:
        """Keys with a lock remembered."""
        return len(self._held)

    def add(self, owner: str, keys: Iterable[OffloadKey]) -> None:
        """`owner` (a lookup) locked `keys`."""
        if self.lease <= 0:
            return  # no tier of the chain takes claims: nothing to let go
        now = self._clock()
        ends = now + self.lease
        with self._lock:
            self._forget(now)
            for key in keys:
                self._held.setdefault(key, deque()).append((ends, owner))
                self._order.append((ends, key))

    def take(self, keys: Iterable[OffloadKey]) -> dict[str, list[OffloadKey]]:
        """One lock on each of `keys` ends: by owner, the keys to let go (keys with no
        live lock are skipped)."""
        now = self._clock()
        ending: dict[str, list[OffloadKey]] = {}
        with self._lock:
            for key in keys:
                held = self._held.get(key)
                while held and held[0][0] <= now:
                    held.popleft()
                if held:
                    _, owner = held.popleft()
                    ending.setdefault(owner, []).append(key)
                if not held:
                    self._held.pop(key, None)
        return ending

    def _forget(self, now: float) -> None:
        """Under the lock: drop locks whose lease ran out (the tier dropped them)."""
        order, held = self._order, self._held
        while order and order[0][0] <= now:
            _, key = order.popleft()
            owners = held.get(key)
            while owners and owners[0][0] <= now:
                owners.popleft()
            if owners is not None and not owners:
                del held[key]
