"""The plugin contract's public names, under the name plugin authors import.

    from tierkv.tier import SecondaryTierManager, TierConfig, run_job, ...

The contract itself lives in `tierkv.contract` (this module re-exports
`tierkv.contract.tier`, which gathers what a tier needs from the contract's modules).
It stays here so a plugin has one stable import while the contract's modules move;
like the contract, it imports no torch and nothing of the cache.

Register a tier with an entry point:

    [project.entry-points."tierkv.tiers"]
    mytier = "my_package:MyTier"
"""

from __future__ import annotations

# every public name of the contract's main module, and its `__all__` (one list to keep)
from tierkv.contract.tier import *  # noqa: F403
from tierkv.contract.tier import __all__ as __all__
