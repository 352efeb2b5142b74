"""The primary tier against a simple model, driven by hypothesis.

The model knows which keys are writing or ready, their readers and their bytes, but
not which victim a policy picks: it checks that each choice is legal. Invariants after
every step: no slot is handed to two live keys, a ready key reads back the bytes
written to it, and the evictable count equals the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierkv.primary import PrimaryTier

KEYS = [bytes([65 + i]) * 3 for i in range(8)]
BLOCK = 16
CAPACITY = 4


@dataclass
class Entry:
    slot: int
    ready: bool
    readers: int
    data: bytes


class PrimaryMachine(RuleBasedStateMachine):
    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.primary = PrimaryTier(CAPACITY, BLOCK, eviction=self.eviction, pin_memory=False)
        self.model: dict[bytes, Entry] = {}
        self.counter = 0

    def evictable(self, exclude: set[bytes]) -> int:
        return sum(
            1 for k, e in self.model.items() if e.ready and e.readers == 0 and k not in exclude
        )

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def prepare_store(self, keys: list[bytes]) -> None:
        new = list(dict.fromkeys(k for k in keys if k not in self.model))
        free = CAPACITY - len(self.model)
        shortfall = len(new) - free
        possible = shortfall <= 0 or self.evictable(set(keys)) >= shortfall
        out = self.primary.prepare_store(keys)
        if not possible:
            assert out is None
            return
        assert out is not None
        assert out.keys_to_store == new
        assert len(out.evicted_keys) == max(shortfall, 0)
        for victim in out.evicted_keys:
            entry = self.model.pop(victim)
            assert entry.ready and entry.readers == 0 and victim not in keys
        for key, slot in zip(out.keys_to_store, out.slots):
            self.counter += 1
            data = self.counter.to_bytes(4, "big") * (BLOCK // 4)
            self.primary.view.block(slot)[:] = data
            self.model[key] = Entry(slot, ready=False, readers=0, data=data)

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        writing = [k for k, e in self.model.items() if not e.ready]
        keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=4)) + (
            data.draw(st.lists(st.sampled_from(writing), max_size=4)) if writing else []
        )
        self.primary.complete_store(keys, success=success)
        for key in set(keys):
            entry = self.model.get(key)
            if entry is None or entry.ready:
                continue
            if success:
                entry.ready = True
            else:
                del self.model[key]

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        ready = [k for k, e in self.model.items() if e.ready]
        if not ready:
            return
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3))
        slots = self.primary.prepare_load(keys)
        assert slots == [self.model[k].slot for k in keys]
        for key in keys:
            self.model[key].readers += 1

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        read = [k for k, e in self.model.items() if e.readers]
        if not read:
            return
        key = data.draw(st.sampled_from(read))
        self.primary.complete_load([key])
        self.model[key].readers -= 1

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def touch(self, keys: list[bytes]) -> None:
        self.primary.touch(keys)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def lookup(self, keys: list[bytes]) -> None:
        expected = 0
        for key in keys:
            entry = self.model.get(key)
            if entry is None or not entry.ready:
                break
            expected += 1
        assert self.primary.lookup(keys) == expected

    @invariant()
    def slots_are_exclusive(self) -> None:
        slots = [e.slot for e in self.model.values()]
        assert len(slots) == len(set(slots))
        assert all(0 <= s < CAPACITY for s in slots)
        assert self.primary.num_free == CAPACITY - len(self.model)
        assert len(self.primary) == len(self.model)

    @invariant()
    def ready_blocks_read_back(self) -> None:
        for key, entry in self.model.items():
            assert self.primary.slot_of(key) == entry.slot
            if entry.ready:
                assert bytes(self.primary.view.block(entry.slot)) == entry.data

    @invariant()
    def evictable_count_matches(self) -> None:
        assert self.primary.num_evictable == self.evictable(set())
        assert len(self.primary.policy) == len(self.model)


class ArcPrimaryMachine(PrimaryMachine):
    eviction = "arc"


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLRUPrimaryMachine = PrimaryMachine.TestCase
TestLRUPrimaryMachine.settings = _settings
TestARCPrimaryMachine = ArcPrimaryMachine.TestCase
TestARCPrimaryMachine.settings = _settings
