"""The README's plugin skeleton imports everything it uses from the contract, runs,
and a tier made from it keeps the contract's shape."""

from __future__ import annotations

import sys
from collections.abc import Callable

import anyio


def test_the_skeleton_runs_with_only_its_own_imports(readme_block: Callable[..., str]) -> None:
    scope: dict[str, object] = {"__name__": "readme_plugin"}
    exec(
        compile(readme_block("## Write a tier plugin"), "README.md", "exec", dont_inherit=True),
        scope,
    )
    from tierkv.jobs import JobMetadata
    from tierkv.keys import make_offload_key
    from tierkv.slab import PrimaryView

    tier_class = scope["FloppyTier"]
    config_class = scope["FloppyConfig"]
    tier = tier_class(config_class(type="floppy"), PrimaryView(bytearray(64), 16, "ns"))  # type: ignore[operator]
    assert tier.get_tier_type() == "floppy"
    job = JobMetadata(1, (make_offload_key(b"k" * 16, 0),), (0,))
    result = anyio.run(tier.store, job)
    assert result.ok_keys == job.keys  # the skeleton's store "writes" every frame
    assert "torch" not in scope  # the contract alone; nothing heavy imported by it
    assert all(not m.startswith("tierkv.cache") for m in scope)
    assert sys.modules.get("tierkv.tier") is not None
