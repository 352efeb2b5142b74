"""The plugin contract's public names, under the name plugin authors import.

    from tierkv.contract.tier import SecondaryTierManager, TierConfig, run_job, ...

The contract itself lives in `tierkv.contract` (this module re-exports
`tierkv.contract.tier`, which gathers what a tier needs from the contract's modules).
It stays here so a plugin has one stable import while the contract's modules move;
like the contract, it imports no torch and nothing of the cache.

Register a tier with an entry point:

    [project.entry-points."tierkv.tiers"]
    mytier = "my_package:MyTier"
"""

from __future__ import annotations

from tierkv.contract.tier import (
    Batch,
    CorruptBlock,
    Duration,
    ForeignBlock,
    Framer,
    InFlightJobs,
    IOThreads,
    JobAborted,
    JobMetadata,
    JobResult,
    OffloadKey,
    PrimaryView,
    RemovalListener,
    ReqContext,
    SecondaryTierManager,
    Size,
    SlotGuard,
    TierConfig,
    TierUnavailable,
    WritePolicy,
    detached,
    in_batches,
    in_thread,
    per_key,
    redact_url,
    run_job,
)

__all__ = [
    "redact_url",
    "Batch",
    "CorruptBlock",
    "detached",
    "Duration",
    "ForeignBlock",
    "Framer",
    "InFlightJobs",
    "IOThreads",
    "JobAborted",
    "JobMetadata",
    "JobResult",
    "OffloadKey",
    "PrimaryView",
    "RemovalListener",
    "ReqContext",
    "SecondaryTierManager",
    "SlotGuard",
    "Size",
    "TierConfig",
    "TierUnavailable",
    "WritePolicy",
    "in_batches",
    "in_thread",
    "per_key",
    "run_job",
]
