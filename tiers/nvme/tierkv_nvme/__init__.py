"""tierkv-cache-nvme: the `nvme` tier, KV-cache blocks as checksummed files on a local disk.

Installed, it registers itself in the `tierkv.tiers` entry-point group, so a YAML
chain can say

    tiers:
      - {type: nvme, path: /mnt/nvme/tierkv, capacity: 500GiB}

or `paths: [...]`, one directory per drive, for one tier striped over them
(`StripedNvmeTier`, which `NvmeTier(config, primary)` builds for such a config).

It uses only tierkv's public plugin API (`tierkv.tier`, `tierkv.contract.framing`).
"""

from __future__ import annotations

from tierkv_nvme.config import NvmeTierConfig
from tierkv_nvme.striped import StripedNvmeTier
from tierkv_nvme.tier import NvmeTier, RecoveryReport, disk_footprint

__version__ = "0.1.0"

__all__ = [
    "NvmeTier",
    "NvmeTierConfig",
    "RecoveryReport",
    "StripedNvmeTier",
    "__version__",
    "disk_footprint",
]
