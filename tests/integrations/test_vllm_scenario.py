"""Many scheduler steps under vLLM's REAL tiering manager, the way a server drives it:
conversations that come back, over a primary of 8 rows and a working set five times
that, through an evicting memory tier and an nvme tier, with the garbage collector
off from the first step to vLLM's unmap.

What must hold at every step: a HIT loads the bytes stored under its key (never
another key's), no job is reported twice (vLLM's manager asserts that itself), every
request settles in a bounded number of steps, and at the end vLLM unmaps its primary.
"""

from __future__ import annotations

import gc
import logging
import random
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ROWS = 8
CONVERSATIONS = 10
TURN_KEYS = 4  # keys a turn adds; a conversation's prefix grows turn by turn


def test_conversations_over_a_primary_much_smaller_than_the_working_set(
    vllm: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(19)
    memory = {"type": "memory", "capacity": 12 * (4096 + 256)}  # evicts: ~12 rows
    nvme = {"type": "nvme", "path": str(tmp_path / "nvme"), "capacity": "8MiB"}
    gc.collect()
    gc.disable()
    try:
        engine = vllm.engine([vllm.entry(memory), vllm.entry(nvme)], chunks=ROWS)
        keys = {c: vllm.keys(TURN_KEYS * 3, f"conversation-{c}") for c in range(CONVERSATIONS)}
        turns = dict.fromkeys(range(CONVERSATIONS), 0)
        hits_total, steps_max = 0, 0
        promoted: dict[str, int] = {}  # bytes promoted from each secondary tier
        for _ in range(60):
            c = rng.randrange(CONVERSATIONS)
            turn = turns[c] = min(turns[c] + 1, 3)
            # the prompt: the conversation so far; the last turn's keys are new, and at
            # most ROWS - 2 keys are asked at once (the primary must hold a request)
            prompt = keys[c][: turn * TURN_KEYS][-(ROWS - 2) :]
            ctx = engine.new_request()
            hits = engine.promote(ctx, prompt, timeout=30)
            steps_max = max(steps_max, engine.last_steps)
            if hits:
                rows = engine.read(ctx, prompt[:hits])
                assert rows == [vllm.payload(k) for k in prompt[:hits]], "a HIT loaded wrong bytes"
                hits_total += hits
            engine.store(ctx, prompt[hits:])
            engine.finish(ctx)
            engine.settle(timeout=30)
            for tier, n in _promoted_bytes(engine).items():
                promoted[tier] = promoted.get(tier, 0) + n
        assert hits_total > 0, "no reuse was served at all"
        assert set(promoted) == {"1:tierkv", "2:tierkv"}, f"promotions per tier: {promoted}"
        assert 0 < steps_max < 500, steps_max  # promotions took steps, and not forever
        assert not engine.busy()
        caplog.set_level(logging.WARNING)
        engine.shutdown()
        assert not [r for r in caplog.records if "Keeping" in r.getMessage()], caplog.text
        assert engine.manager.primary_tier._mmap_region.mmap_obj is None
    finally:
        gc.enable()


def _promoted_bytes(engine: Any) -> dict[str, int]:
    """Bytes vLLM promoted from each secondary tier since the last call (its own
    metrics, by tier label)."""
    from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics

    stats = engine.manager.get_stats()
    if stats is None:
        return {}
    _types, values = stats.metric_sections()
    series = values.get(TieringOffloadingMetrics.READ_BYTES, {})
    return {labels[0]: int(n) for labels, n in series.items() if n}
