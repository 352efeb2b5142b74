"""tierkv tiers as SGLang HiCache's L3 storage backend (`pip install -e '.[sglang]'`).

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tierkv",
      "module_path": "tierkv.integrations.sglang", "class_name": "TierkvHiCacheStorage",
      "interface_v1": 1,
      "tiers": [{"type": "nvme", "path": "/mnt/nvme/kv", "capacity": "500GiB"}]}'

`storage.TierkvHiCacheStorage` is the backend; `settings` validates the extra config
and `pages` maps the host pool, neither importing SGLang. Importing this package
imports no SGLang: the backend class loads on first use (SGLang's loader asks for it
by name).
"""

from __future__ import annotations

from typing import Any

from tierkv.integrations.sglang.settings import ChainSettings, PoolGeometry, resolve

__all__ = ["ChainSettings", "PoolGeometry", "TierkvHiCacheStorage", "resolve"]


def __getattr__(name: str) -> Any:
    if name == "TierkvHiCacheStorage":
        from tierkv.integrations.sglang.storage import TierkvHiCacheStorage

        return TierkvHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
