"""tierkv tiers as vLLM KV-offloading secondary tiers (`pip install -e '.[vllm]'`).

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "tierkv",
          "tier": {"type": "nvme", "path": "/mnt/nvme/kv", "capacity": "500GiB"}}]}}'

`plugin.register` (a `vllm.general_plugins` entry point) tells vLLM the `tierkv`
type; `tier.TierkvSecondaryTier` is the adapter; `settings` validates the entry
without importing vLLM. Importing this package imports no vLLM.
"""

from __future__ import annotations

from tierkv.integrations.vllm.plugin import TIER_TYPE, register
from tierkv.integrations.vllm.settings import TierkvEntry, VllmGeometry, resolve_entry

__all__ = ["TIER_TYPE", "TierkvEntry", "VllmGeometry", "register", "resolve_entry"]
