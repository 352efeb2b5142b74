"""tierkv-cache-mooncake: the `mooncake` tier. KV-cache blocks as objects in Mooncake
Store, framed and checked, shared by every inference server of a fleet that mounts
segments of one master (over TCP, or RDMA where the hardware has it)."""

from __future__ import annotations

from tierkv_mooncake.config import MooncakeTierConfig
from tierkv_mooncake.tier import MooncakeTier

__all__ = ["MooncakeTier", "MooncakeTierConfig"]
