"""The `vllm.general_plugins` entry point: makes `"type": "tierkv"` known to vLLM.

vLLM runs every `vllm.general_plugins` entry point once in each of its processes
at start-up (API server, engine core, workers). Registering is cheap: vLLM's factory
stores the module path and imports `tierkv.integrations.vllm.tier` only when a
`secondary_tiers` entry names `tierkv`.
"""

from __future__ import annotations

import contextlib
import logging

logger = logging.getLogger(__name__)

TIER_TYPE = "tierkv"
ADAPTER = ("tierkv.integrations.vllm.tier", "TierkvSecondaryTier")


def register() -> None:
    """Register the tierkv adapter with vLLM's `SecondaryTierFactory` (idempotent)."""
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError as exc:  # a vLLM without the tiering framework
        logger.warning("tierkv: this vLLM has no kv_offload tiering (%s); not registered", exc)
        return
    with contextlib.suppress(ValueError):  # already registered in this process
        SecondaryTierFactory.register_tier(TIER_TYPE, *ADAPTER)
