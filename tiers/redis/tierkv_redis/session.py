"""What an open redis tier works with: made by `open()`, let go by `close()`.

Every operation module (`jobs`, `lookups`, `removal`) takes one `Session` rather than
the tier, so each sees exactly what it may use: the node map, the gate on commands in
flight, the worker threads, the block names and the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from tierkv.tier import IOThreads
from tierkv_redis.config import RedisTierConfig
from tierkv_redis.names import BlockNames
from tierkv_redis.routing import NodeMap


@dataclass(frozen=True)
class Session:
    nodes: NodeMap  # one server, or a cluster's slot map
    # commands in flight across all jobs and lookups of the tier; never more than a
    # node's connection pool holds
    gate: anyio.Semaphore
    # one worker thread per connection (a thread holds its connection for its batch)
    threads: IOThreads
    names: BlockNames
    config: RedisTierConfig
