"""The mooncake tier under an engine (`PrimaryView.engine_owned`, as `SyncChain` marks
SGLang's and LMCache's pools): loads land in a staging arena of the tier's own and
reach the engine's pages only while their job is on time, so a transfer a frozen peer
held up past the engine's answer writes no page the engine may have handed out again.
Against a real master and a segment held by another process."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from tierkv_mooncake import MooncakeTier, MooncakeTierConfig
from tierkv_mooncake.testing import MooncakeMaster, SegmentHolder

from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.slab import PrimaryView
from tierkv.driver.sync_chain import SyncChain
from tierkv.testing import fill_slots, random_keys

pytestmark = pytest.mark.anyio

CTX = ReqContext(request_id="mooncake-engine")
BLOCK = 64 << 10
SENTINEL = 0x5A


def config(master: MooncakeMaster, **fields: Any) -> MooncakeTierConfig:
    return MooncakeTierConfig.model_validate(
        {
            "type": "mooncake",
            "master": master.master,
            "metadata_server": master.metadata_server,
            "batch_blocks": 4,
            **fields,
        }
    )


async def test_under_an_engine_loads_are_staged_and_arrive_whole(
    mooncake_store: MooncakeMaster,
) -> None:
    """More batches than lanes, each lane through its own part of the staging arena:
    every block arrives byte-identical in its page; without an engine nothing is
    staged."""
    rng = random.Random(7)
    plain = MooncakeTier(config(mooncake_store), PrimaryView(bytearray(4 * BLOCK), BLOCK, "p"))
    assert plain.describe()["staged_loads"] is False  # not open: nothing registered
    view = PrimaryView(bytearray(64 * BLOCK), BLOCK, "engine-staged")
    view.engine_owned = True
    tier = MooncakeTier(config(mooncake_store, concurrency=2), view)
    await tier.open()
    try:
        assert tier.describe()["staged_loads"] is True
        keys = random_keys(24, rng)
        written = fill_slots(view, range(24), rng)
        stored = await tier.store(JobMetadata(1, tuple(keys), tuple(range(24)), CTX))
        assert stored.ok, stored.error
        dest = list(range(32, 56))
        for slot in dest:
            view.block(slot)[:] = bytes(BLOCK)
        loaded = await tier.load(JobMetadata(2, tuple(keys), tuple(dest), CTX))
        assert loaded.ok, loaded.error
        assert [bytes(view.block(s)) for s in dest] == [written[s] for s in range(24)]
        # every staging part held (by transfers an engine's calls left behind): the
        # batch fails, naming why, and its pages are left alone
        held = [tier._staging_parts.get_nowait() for _ in range(4)]
        view.block(60)[:] = bytes([SENTINEL]) * BLOCK
        busy = await tier.load(JobMetadata(3, (keys[0],), (60,), CTX))
        assert busy.failed_keys == (keys[0],) and "staging part" in busy.error
        assert bytes(view.block(60)) == bytes([SENTINEL]) * BLOCK
        for part in held:
            tier._staging_parts.put(part)
        await tier.remove(keys[:1])  # a block the store lost: a miss, its page alone
        missing = await tier.load(JobMetadata(4, tuple(keys[:1]), (60,), CTX))
        assert missing.failed_keys == (keys[0],)
        assert bytes(view.block(60)) == bytes([SENTINEL]) * BLOCK
    finally:
        await tier.close()
    assert tier.describe()["open"] is False


def test_a_transfer_that_ends_after_the_engines_answer_writes_no_page(
    fresh_master: MooncakeMaster,
) -> None:
    """Through `SyncChain`, as an engine calls it: the node holding the blocks freezes
    (SIGSTOP), the chain answers misses at its deadline plus margin, then the node
    thaws while the transfer is still waiting (within `transfer_timeout`) and the
    transfer completes. The engine's pages stay as they were: the bytes landed in
    staging, past the deadline, and were not copied in."""
    rng = random.Random(11)
    view = PrimaryView(bytearray(32 * BLOCK), BLOCK, "engine-frozen")
    with SegmentHolder(fresh_master, 32 << 20) as holder:
        tier_config = config(fresh_master, job_timeout="500ms", transfer_timeout="5s")
        chain = SyncChain([tier_config], ["mooncake"], view, margin=0.1)
        try:
            tier = chain.tiers[0].tier
            assert isinstance(tier, MooncakeTier) and view.engine_owned
            keys: list[OffloadKey] = random_keys(4, rng)
            written = fill_slots(view, range(4), rng)
            assert chain.store(keys, [0, 1, 2, 3]) == set(keys)
            dest = [8, 9, 10, 11]
            for slot in dest:
                view.block(slot)[:] = bytes([SENTINEL]) * BLOCK
            holder.freeze()
            thawed = threading.Timer(chain.job_deadline + chain.margin + 0.5, holder.thaw)
            thawed.start()
            try:
                started = time.monotonic()
                assert chain.load(keys, dest) == set()  # misses, by the deadline
                answered = time.monotonic() - started
                assert answered < chain.job_deadline + chain.margin + 0.3
                thawed.join()
                # the transfer resumes and completes now, into staging; its lane's
                # thread (left behind by the chain's answer) gives its part back
                parts = 2 * tier_config.concurrency
                deadline = time.monotonic() + 5
                while tier._staging_parts.qsize() < parts and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.2)
            finally:
                thawed.cancel()
                holder.thaw()
            for slot in dest:  # the engine's pages: untouched after the answer
                assert bytes(view.block(slot)) == bytes([SENTINEL]) * BLOCK
            assert tier._staging_parts.qsize() == parts, "the held-up load never ended"
            # and the tier serves again, into the same pages
            assert chain.load(keys, dest) == set(keys)
            assert [bytes(view.block(s)) for s in dest] == [written[s] for s in range(4)]
        finally:
            chain.close()
