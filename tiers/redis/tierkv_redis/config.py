"""The `type: redis` section of the YAML.

    - type: redis
      url: "redis://:${REDIS_PASSWORD}@10.0.0.5:6379/0"   # or rediss:// for TLS
      ttl: 6h
      max_connections: 16

The password may sit in the URL or in `password` (never both). Neither ever appears
in a repr, a log line or `describe()`: URLs are shown with the password replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import ByteSize, Field, PositiveInt, SecretStr, field_validator, model_validator

from tierkv.contract.units import Duration, Size
from tierkv.tier import TierConfig, redact_url

MIN_PART_SIZE = 1024
"""Smallest `part_size` accepted; tests use tiny parts to exercise splitting."""

PIPELINE_BYTES = 2 << 20
"""`pipeline_size: auto`: blocks per pipeline that make about this many bytes."""
SINGLE_COMMAND_BYTES = 1 << 20
"""`pipeline_size: auto`: blocks of at least this size are not pipelined: several go
to one worker-thread call, each command sent once the last one's reply is read
(`transfer_plan`)."""
MAX_AUTO_PIPELINE = 64
"""`pipeline_size: auto`: at most this many blocks per pipeline (tiny blocks)."""
LARGE_CALL_BYTES = 16 << 20
"""`pipeline_size: auto`, MiB-sized blocks: at most this many bytes of blocks per
worker-thread call (its commands sent one at a time, `Plan`)."""
LARGE_CALLS = 4
"""`pipeline_size: auto`, MiB-sized blocks: worker-thread calls at once per node."""


@dataclass(frozen=True)
class Plan:
    """How a job's blocks go to a node: `blocks` per worker-thread call, at most
    `calls` calls at once; `in_turn`: each call sends its commands one at a time
    (the next once the reply to the last is read) instead of as one pipeline."""

    blocks: int
    calls: int
    in_turn: bool

    def batch_size(self, count: int) -> int:
        """Blocks per call for a node's `count` blocks: spread over `calls` calls
        where the blocks are sent in turn, but never more than `blocks`."""
        if not self.in_turn:
            return self.blocks
        return max(1, min(self.blocks, -(-count // self.calls)))


def transfer_plan(
    pipeline_size: int | Literal["auto"], block_bytes: int, max_connections: int
) -> Plan:
    """The `Plan` for blocks of `block_bytes`.

    MiB-sized blocks (`auto`) go several to a call, in turn, at most `LARGE_CALLS`
    calls at once. Measured on the 2-core dev VM through the LMCache adapter
    (16 blocks per job): one call per 1 MiB block cost the event loop 180-280 us of CPU
    per call (the thread hop and the task around it) and the server, with 16 large
    replies buffered at once, 0.5 ms of CPU per MiB at 1 MiB and 1 ms at 8 MiB; a plain
    client reading 1 MiB values one at a time on 4 connections moved 2.6 GB/s, with
    0.4 ms of server CPU per MiB. Pipelining large values bought nothing there."""
    blocks = pipeline_blocks(pipeline_size, block_bytes)
    if pipeline_size == "auto" and block_bytes >= SINGLE_COMMAND_BYTES:
        per_call = max(1, LARGE_CALL_BYTES // block_bytes)
        return Plan(per_call, min(max_connections, LARGE_CALLS), in_turn=True)
    return Plan(blocks, max_connections, in_turn=False)


def pipeline_blocks(pipeline_size: int | Literal["auto"], block_bytes: int) -> int:
    """Blocks per pipeline for blocks of `block_bytes`. Measured on loopback (tierkv
    bench, 8-block calls, 8 in flight): pipelines of 8 beat single commands 2.7x for
    64 KiB blocks and 2x for 256 KiB; for 1 MiB blocks pipelines of 4 loaded 19 %
    slower, so MiB-sized blocks are not pipelined (`transfer_plan` sends them in
    turn, several to a call)."""
    if pipeline_size != "auto":
        return pipeline_size
    if block_bytes >= SINGLE_COMMAND_BYTES:
        return 1
    return max(1, min(MAX_AUTO_PIPELINE, PIPELINE_BYTES // max(1, block_bytes)))


class RedisTierConfig(TierConfig):
    """Where the Redis server is and how the tier talks to it."""

    type: Literal["redis"] = "redis"
    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="redis://[user:password@]host:port/db, or rediss:// for TLS; query "
        "options (e.g. ?ssl_cert_reqs=none) pass through to redis-py",
    )
    password: SecretStr | None = Field(
        default=None, description="the AUTH password, if not in the URL (e.g. ${REDIS_PASSWORD})"
    )
    key_prefix: str = Field(
        default="tierkv:",
        description="start of every stored name; the namespace tag and the block key "
        "follow it, so namespaces never see each other's blocks",
    )
    ttl: Duration | None = Field(
        default=None,
        gt=0,
        description="expire blocks this long after they were last stored or loaded; "
        "None keeps them until Redis evicts them (set maxmemory-policy allkeys-lru)",
    )
    max_connections: PositiveInt = Field(
        default=16, description="connections (per cluster node), and commands in flight"
    )
    pipeline_size: PositiveInt | Literal["auto"] = Field(
        default="auto",
        description="commands sent per pipeline for stores and loads; 1 sends each "
        "block as its own command, concurrently; auto: blocks under 1 MiB go in "
        "pipelines of up to 2 MiB, larger ones up to 16 MiB to a call, each command "
        "sent once the last one's reply is read, 4 calls at once",
    )
    lookup_batch: PositiveInt = Field(
        default=256, description="EXISTS commands per pipeline in a lookup"
    )
    socket_timeout: Duration = Field(
        default=2.0,
        gt=0,
        description="connect and per-command timeout; an unreachable Redis fails a "
        "job's keys within about this long",
    )
    part_size: Size = Field(
        default=ByteSize(8 << 20),
        description="frames larger than this are stored as several values of at most "
        "this size under one logical key",
    )
    fit_values: bool = Field(
        default=False,
        description="cut frames of 256 KiB and up so Redis's allocator wastes nothing on "
        "them (a 1 MiB block and its header otherwise take a 1.25 MiB allocation): "
        "about a fifth more blocks in the same maxmemory, for slower loads (measured "
        "on Redis 7.0: 7-20 % at 256 KiB-2 MiB, ~38 % at 8 MiB; the tier's README). Servers "
        "sharing a namespace must agree: each misses the other's blocks",
    )
    cluster: bool = Field(
        default=False,
        description="the url names a node of a Redis Cluster; the tier reads the slot "
        "map from it and talks to each node itself, so a node that is down costs only "
        "the blocks of its slots",
    )
    read_from_replicas: bool = Field(
        default=False,
        description="cluster only: lookups, and loads when no ttl is renewed on read, "
        "rotate over each slot's master and replicas. A replica lags its master: a block "
        "just stored may miss there (a stale or partial value fails its frame checks "
        "and is a miss, never wrong bytes)",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(
                f"{redact_url(url)!r} is not a Redis URL: use redis://host:port/db "
                "(or rediss:// for TLS)"
            )
        if not parts.hostname:
            raise ValueError(f"{redact_url(url)!r} names no host")
        return url

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, prefix: str) -> str:
        if "{" in prefix or "}" in prefix:
            raise ValueError(
                f"{prefix!r} contains '{{' or '}}': the tier puts a Redis Cluster hash "
                "tag around each block key, and braces in the prefix would break it"
            )
        return prefix

    @field_validator("part_size")
    @classmethod
    def _check_part_size(cls, size: ByteSize) -> ByteSize:
        if size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes")
        return size

    @model_validator(mode="after")
    def _one_password(self) -> RedisTierConfig:
        if self.password is not None and urlsplit(self.url).password is not None:
            raise ValueError("the password is given twice: put it in `url` or `password`, not both")
        return self

    @model_validator(mode="after")
    def _replicas_need_a_cluster(self) -> RedisTierConfig:
        if self.read_from_replicas and not self.cluster:
            raise ValueError(
                "read_from_replicas needs `cluster: true` (a single server has no replicas "
                "the tier knows of)"
            )
        return self

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            yield name, (redact_url(value) if name == "url" else value)

    @property
    def safe_url(self) -> str:
        """The URL with its password replaced, for messages."""
        return redact_url(self.url)
