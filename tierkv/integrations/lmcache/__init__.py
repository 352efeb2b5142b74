"""tierkv tiers as an L2 adapter of LMCache's server mode (`pip install -e '.[lmcache]'`).

    lmcache server ... --l2-adapter '{"type": "plugin",
      "module_path": "tierkv.integrations.lmcache", "class_name": "TierkvL2Adapter",
      "adapter_params": {"tiers": [{"type": "nvme", "path": "/mnt/nvme/kv",
                                    "capacity": "500GiB"}]}}'

`adapter.TierkvL2Adapter` is the adapter; `settings` validates `adapter_params`,
`keys` maps LMCache's object keys, `tasks` and `locks` keep its task and lock
protocol, `objects` and `chains` lend its memory objects to the tiers, `record` keeps
which keys the tiers hold (for its key listing and usage); none of these but
`adapter` imports LMCache. Importing this package imports no LMCache: the adapter
class loads on first use (LMCache's loader asks for it by name).
"""

from __future__ import annotations

from typing import Any

from tierkv.integrations.lmcache.settings import AdapterSettings, resolve

__all__ = ["AdapterSettings", "TierkvL2Adapter", "resolve"]


def __getattr__(name: str) -> Any:
    if name == "TierkvL2Adapter":
        from tierkv.integrations.lmcache.adapter import TierkvL2Adapter

        return TierkvL2Adapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
