"""The `type: mooncake` section of the YAML.

    - type: mooncake
      master: 10.0.0.5:50051                        # mooncake_master's RPC address
      metadata_server: http://10.0.0.5:8080/metadata
      segment_size: 16GiB                           # memory this server lends the store
      protocol: tcp                                 # or rdma, with rdma_devices
      replicas: 1

Capacity is the store's, not the tier's: Mooncake Store holds objects in the memory
segments its clients mount, and evicts on its own terms when they fill. A tier with
`segment_size: S` mounts one segment of S bytes of this process's memory (0: a pure
client, lending nothing, storing into the segments other servers lend); the store's
capacity is the sum of every mounted segment. A block takes `header_bytes(key) +
block_bytes` of it (the frame), so a segment holds about `S // (block_bytes + ~110)`
blocks; the master starts evicting at `eviction_high_watermark_ratio` (0.9) of a
segment. There is no `capacity` field: what bounds the tier is `segment_size` here
plus whatever the rest of the fleet lends.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import ByteSize, Field, PositiveInt, field_validator, model_validator

from tierkv.contract.units import Duration, Size
from tierkv.tier import TierConfig

MIN_SEGMENT = 16 << 20
"""The smallest segment Mooncake 0.3.13 mounts (8 MiB fails its setup)."""

_HOST_PORT = re.compile(
    r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):(?P<port>\d{1,5})$"
)
_DEVICE = re.compile(r"^[A-Za-z0-9_.\-]+(:\d+)?$")


def split_host_port(address: str) -> tuple[str, int]:
    """`10.0.0.5:50051` -> ("10.0.0.5", 50051); ValueError naming the address otherwise."""
    match = _HOST_PORT.match(address)
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"{address!r} is not host:port (e.g. 10.0.0.5:50051)")
    return match["host"].strip("[]"), int(match["port"])


class MooncakeTierConfig(TierConfig):
    """Where the Mooncake master is, what this process lends the store, and how
    blocks travel."""

    type: Literal["mooncake"] = "mooncake"
    master: str = Field(
        default="127.0.0.1:50051",
        description="host:port of mooncake_master's RPC service (its --rpc_port)",
    )
    metadata_server: str = Field(
        default="http://127.0.0.1:8080/metadata",
        description="the transfer engine's metadata service: mooncake_master's own HTTP "
        "one (--enable_http_metadata_server) is http://host:port/metadata; etcd://host:port "
        "or redis://host:port for an external one",
    )
    local_hostname: str = Field(
        default="127.0.0.1",
        description="the address other nodes reach this process at (its segment and "
        "transfers); on a fleet, this node's address on the storage network",
    )
    segment_size: Size = Field(
        default=ByteSize(0),
        description="memory this process lends the store as its segment (Mooncake's "
        "global_segment_size); 0: a pure client storing into the segments other "
        "processes lend. The store's capacity is the sum of every segment",
    )
    local_buffer_size: Size = Field(
        default=ByteSize(16 << 20),
        description="the client's staging buffer (Mooncake's local_buffer_size); blocks "
        "move zero-copy from the registered primary slab, so it stays small",
    )
    protocol: Literal["tcp", "rdma"] = Field(
        default="tcp", description="how block bytes travel between nodes"
    )
    rdma_devices: str = Field(
        default="",
        description="with protocol rdma: comma-separated device names (mlx5_0,mlx5_1); "
        "empty lets Mooncake pick",
    )
    replicas: PositiveInt = Field(
        default=1, le=16, description="copies the store keeps of each block, on distinct segments"
    )
    key_prefix: str = Field(
        default="tierkv/",
        max_length=64,
        description="start of every stored name; the namespace tag and the block key "
        "follow it, so namespaces never see each other's blocks",
    )
    batch_blocks: PositiveInt = Field(
        default=16,
        description="blocks per batched call (batch_put_from / batch_get_into); a job "
        "moves its batches `concurrency` at a time",
    )
    concurrency: PositiveInt = Field(
        default=2,
        description="batched calls of the tier in flight: a job moves in this many lanes, "
        "each a worker thread taking batch after batch",
    )
    transfer_timeout: Duration | None = Field(
        default=None,
        description="with tcp: seconds a transfer may make no progress before it fails "
        "(a frozen node); default min(2s, job_timeout / 2). Sets Mooncake's "
        "MC_TCP_PROGRESS_TIMEOUT_SEC, which is process-wide: the first tier to open sets "
        "it, and a variable already exported wins",
    )
    connect_timeout: float = Field(
        default=2.0,
        gt=0,
        description="seconds open() waits for the master's and metadata server's ports "
        "before it reports the store unreachable (Mooncake's own setup retries for ~90 s)",
    )

    @field_validator("master")
    @classmethod
    def _check_master(cls, address: str) -> str:
        split_host_port(address)
        return address

    @field_validator("metadata_server")
    @classmethod
    def _check_metadata(cls, url: str) -> str:
        if url == "P2PHANDSHAKE":
            return url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https", "etcd", "redis") or not parts.hostname:
            raise ValueError(
                f"{url!r} is not a metadata server: use http://host:port/metadata "
                "(mooncake_master --enable_http_metadata_server), etcd://host:port, "
                "redis://host:port or P2PHANDSHAKE"
            )
        return url

    @field_validator("segment_size")
    @classmethod
    def _check_segment(cls, size: ByteSize) -> ByteSize:
        if 0 < size < MIN_SEGMENT:
            raise ValueError(
                "segment_size must be 0 (a pure client) or at least 16MiB (Mooncake "
                "refuses smaller segments)"
            )
        return size

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, prefix: str) -> str:
        if not prefix.isprintable() or " " in prefix:
            raise ValueError(f"key_prefix {prefix!r} must be printable, without spaces")
        return prefix

    @field_validator("rdma_devices")
    @classmethod
    def _check_devices(cls, devices: str) -> str:
        for name in filter(None, devices.split(",")):
            if not _DEVICE.match(name.strip()):
                raise ValueError(f"{name!r} is not an RDMA device name (e.g. mlx5_0)")
        return devices

    @model_validator(mode="after")
    def _devices_need_rdma(self) -> MooncakeTierConfig:
        if self.rdma_devices and self.protocol != "rdma":
            raise ValueError("rdma_devices applies to protocol rdma; this tier is tcp")
        return self

    @property
    def transfer_timeout_seconds(self) -> int:
        """Whole seconds (Mooncake reads an integer), at least 1."""
        chosen = self.transfer_timeout
        if chosen is None:
            chosen = min(2.0, self.job_timeout / 2)
        return max(1, round(chosen))

    @property
    def master_address(self) -> tuple[str, int]:
        return split_host_port(self.master)

    @property
    def metadata_address(self) -> tuple[str, int] | None:
        """(host, port) of the metadata server, to probe; None when it has no port."""
        if self.metadata_server == "P2PHANDSHAKE":
            return None
        parts = urlsplit(self.metadata_server)
        default = {"http": 80, "https": 443, "etcd": 2379, "redis": 6379}[parts.scheme]
        assert parts.hostname is not None
        return parts.hostname, parts.port or default
