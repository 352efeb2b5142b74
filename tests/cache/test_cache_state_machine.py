"""The whole cache against its one promise, driven by hypothesis.

Two secondary tiers (a `memory` tier and a `faulty` tier that can go down and whose
stored bytes can be corrupted) under a tiny primary. Random stores, lookups, loads,
evictions, outages and corruptions. Every block's content is a function of its key,
so the check is simple: every load returns exactly the bytes stored under that key or
reports the key failed; and at the end no slot, reader or reservation leaked.

Stores and loads larger than the primary (issue 10) stream through it: a store keeps
the longest prefix (nothing rejected before something stored), a load promotes in
windows and still returns the right bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import hypothesis.strategies as st
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.keys import make_offload_key
from tierkv.registry import register_tier, unregister_tier
from tierkv.testing import FaultyTier

BLOCK = 256
KEYS = [make_offload_key(hashlib.sha256(bytes([i])).digest()[:16], 0) for i in range(12)]
FILLER = [make_offload_key(hashlib.sha256(b"filler%d" % i).digest()[:16], 0) for i in range(4)]


def content(key: bytes) -> bytes:
    return (hashlib.sha256(key).digest() * (BLOCK // 32))[:BLOCK]


def as_blocks(keys: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(content(k) for k in keys)), dtype=torch.uint8).view(
        len(keys), BLOCK
    )


class CacheMachine(RuleBasedStateMachine):
    FAULTY_POLICY = "write_through"

    def __init__(self) -> None:
        super().__init__()
        register_tier(FaultyTier)
        self._portal_cm = start_blocking_portal()
        self.portal: BlockingPortal = self._portal_cm.__enter__()
        config = parse_config(
            {
                "namespace": "sm",
                "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 4}]},
                "primary": {"capacity": 4 * BLOCK, "eviction": "arc", "pin_memory": False},
                "tiers": [
                    {
                        "type": "faulty",
                        "failure_threshold": 2,
                        "recovery_after": 0,
                        "write_policy": self.FAULTY_POLICY,
                    },
                    {"type": "memory", "capacity": 6 * (BLOCK + 64)},
                ],
                "promotion_reserve": 1.0,
                "store_timeout": "2s",
            }
        )
        self.cache = TieredCache(config)
        self.portal.call(self.cache.open)
        tier = self.cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        self.faulty = tier
        self.loads_ok = 0

    def teardown(self) -> None:
        try:
            self.faulty.down = False
            self.portal.call(self.cache.flush)
            self._check_no_leaks()
            self.portal.call(self.cache.close)
        finally:
            self._portal_cm.__exit__(None, None, None)
            unregister_tier("faulty")

    def _check_no_leaks(self) -> None:
        p = self.cache.primary
        for key in p.keys_in_slots():
            assert p.is_ready(key) and p.readers(key) == 0
        assert p.num_evictable == len(p)
        assert self.cache.core.index.promoting == 0 and all(
            self.cache.index.cascading(k) == 0 for k in self.cache.index.known_keys()
        )

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def store(self, keys: list[bytes]) -> None:
        result: Any = self.portal.call(self.cache.store, keys, as_blocks(keys))
        assert set(result.stored) | set(result.already_present) | set(result.rejected) == set(keys)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=5, max_size=10, unique=True))
    def store_larger_than_the_primary(self, keys: list[bytes]) -> None:
        result: Any = self.portal.call(self.cache.store, keys, as_blocks(keys))
        assert set(result.stored) | set(result.already_present) | set(result.rejected) == set(keys)
        if result.rejected:
            first_rejected = min(keys.index(k) for k in result.rejected)
            assert all(keys.index(k) < first_rejected for k in result.stored), "not a prefix"
            assert result.error

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=5, max_size=10, unique=True))
    def streaming_load(self, keys: list[bytes]) -> None:
        self.load(keys)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def lookup_then_load(self, keys: list[bytes]) -> None:
        hit: Any = self.portal.call(self.cache.lookup, [keys])
        assert hit.hit_tokens % 4 == 0 and hit.hit_tokens <= 4 * len(keys)
        self.load(list(hit.keys_to_load))

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def load_few(self, keys: list[bytes]) -> None:
        self.load(keys)

    def load(self, keys: list[bytes]) -> None:
        if not keys:
            return
        out = torch.zeros((len(keys), BLOCK), dtype=torch.uint8)
        result: Any = self.portal.call(self.cache.load, keys, out)
        assert set(result.ok_keys) | set(result.failed_keys) == set(keys)
        for i, key in enumerate(keys):
            if key in result.ok_keys:
                assert bytes(out[i].numpy()) == content(key), "a load returned wrong bytes"
                self.loads_ok += 1

    @rule()
    def evict(self) -> None:
        """Push every earlier block out of the primary so loads must promote."""
        self.portal.call(self.cache.flush)
        self.portal.call(self.cache.store, FILLER, as_blocks(FILLER))

    @rule()
    def flush(self) -> None:
        self.portal.call(self.cache.flush)

    @rule(down=st.booleans())
    def outage(self, down: bool) -> None:
        self.faulty.down = down

    @rule(key=st.sampled_from(KEYS))
    def corrupt(self, key: bytes) -> None:
        """Flip a stored byte of `key` in the faulty tier, if it holds the key."""
        if key not in self.faulty._frames:
            return
        frame = bytearray(self.faulty._frames[key])
        frame[-1] ^= 0x5A
        self.faulty._frames[key] = bytes(frame)

    @invariant()
    def counts_are_consistent(self) -> None:
        p = self.cache.primary
        assert p.num_free + len(p) == p.num_blocks
        assert 0 <= p.num_evictable <= len(p)
        assert len(p.policy) == len(p)
        assert all(k in p for k in self.cache.index.dirty_keys())


CacheMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestCacheMachine = CacheMachine.TestCase


class WriteBackCacheMachine(CacheMachine):
    """The same, with the faulty tier written back on eviction instead of through."""

    FAULTY_POLICY = "write_back"


WriteBackCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestWriteBackCacheMachine = WriteBackCacheMachine.TestCase
