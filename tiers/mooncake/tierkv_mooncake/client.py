"""The blocking side of the tier: one Mooncake Store client and what its codes mean.

Everything here runs in worker threads (the binding's calls block: an RPC to the
master, a transfer to or from another node's segment). The tier's coroutines hop here
once per lane of a job (a thread that moves batch after batch), never per block.

The binding (`mooncake.store.MooncakeDistributedStore`, 0.3.13) answers each key of a
batched call with an int: bytes moved (a get), 0 (a put or remove), or a negative
Mooncake `ErrorCode`. The ones this tier tells apart, as observed against a real
master on loopback:

- `OBJECT_NOT_FOUND` (-704): the store does not hold the name (never stored, evicted,
  its lease expired, removed, or the segment that held it left): a miss;
- `NO_AVAILABLE_HANDLE` (-200): no segment has room right now (every block is leased
  or the master's eviction has not caught up): the put is refused for room;
- `INVALID_PARAMS` (-600): a get whose buffers are smaller than the stored value: a
  value of another size than our frame (someone else's, or a frame without a MAC);
- `OBJECT_HAS_LEASE` (-706): a remove of an object read or written in the last
  `default_kv_lease_ttl`; the tier removes with `force`, so it does not see it;
- `TRANSFER_FAIL` (-800): the bytes could not be moved to or from the segment (its
  process is gone or frozen: ~30 s on TCP before it gives up);
- `RPC_FAIL` (-900): the master did not answer (down or unreachable).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

from tierkv.tier import TierUnavailable
from tierkv_mooncake.config import MooncakeTierConfig

logger = logging.getLogger(__name__)

NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (no segment has room)",
    INVALID_PARAMS: "INVALID_PARAMS",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    TRANSFER_FAIL: "TRANSFER_FAIL (the segment holding it did not answer)",
    RPC_FAIL: "RPC_FAIL (the master did not answer)",
}

TCP_TIMEOUT_VARIABLES = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
"""Mooncake's TCP transport gives up on a peer that sent nothing for this many seconds
(read when a client is set up; measured: a frozen peer then fails a get in 3 s instead
of 30)."""

INSTALL_HINT = (
    "install the Mooncake Store binding: pip install 'tierkv-cache-mooncake[cpu]' "
    "(mooncake-transfer-engine-non-cuda) or '[cuda]' (mooncake-transfer-engine), and the "
    "system libraries it links: apt-get install libibverbs1 librdmacm1 libnuma1"
)


def describe_code(code: int) -> str:
    return f"{CODE_NAMES.get(code, 'mooncake error')} ({code})"


def address_of(view: memoryview) -> int:
    """The address of a writable buffer's first byte (no reference is kept to it)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def probe(address: tuple[str, int], what: str, timeout: float) -> None:
    """A TCP connect to `address`; TierUnavailable naming `what` when it fails.
    Mooncake's own setup retries an unreachable master for about 90 s."""
    host, port = address
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise TierUnavailable(f"mooncake {what} at {host}:{port} is unreachable: {exc}") from None


class StoreClient:
    """One `MooncakeDistributedStore` set up from the tier's config, with the memory
    regions registered for zero-copy transfers. Blocking: call from worker threads."""

    def __init__(self, config: MooncakeTierConfig) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # type: ignore[import-untyped]
        except ImportError as exc:
            raise TierUnavailable(f"mooncake tier: {exc}; {INSTALL_HINT}") from None
        c = config
        probe(c.master_address, "master", c.connect_timeout)
        metadata = c.metadata_address
        if metadata is not None:
            probe(metadata, "metadata server", c.connect_timeout)
        if c.protocol == "tcp":
            # a transfer to a frozen node otherwise waits ~30 s, and a load's thread
            # (writing its slot from inside the binding) cannot be abandoned
            for variable in TCP_TIMEOUT_VARIABLES:
                os.environ.setdefault(variable, str(c.transfer_timeout_seconds))
        store = MooncakeDistributedStore()
        code = store.setup(
            c.local_hostname,
            c.metadata_server,
            int(c.segment_size),
            int(c.local_buffer_size),
            c.protocol,
            c.rdma_devices,
            c.master,
        )
        if code != 0:
            raise TierUnavailable(
                f"mooncake setup against master {c.master} (metadata {c.metadata_server}, "
                f"{c.protocol}, segment {int(c.segment_size)} bytes) failed with code {code}"
            )
        self.store: Any = store
        self.replicate = ReplicateConfig()
        self.replicate.replica_num = c.replicas
        self._registered: list[int] = []

    def register(self, address: int, size: int) -> None:
        code = self.store.register_buffer(address, size)
        if code != 0:
            raise TierUnavailable(f"mooncake could not register {size} bytes of memory: {code}")
        self._registered.append(address)

    def put(
        self, names: Sequence[str], pointers: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        return list(
            self.store.batch_put_from_multi_buffers(list(names), pointers, sizes, self.replicate)
        )

    def get_into(
        self, names: Sequence[str], pointers: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        return list(self.store.batch_get_into_multi_buffers(list(names), pointers, sizes))

    def get_bytes(self, name: str) -> bytes:
        """The whole value (a copy): only to judge a value of an unexpected size."""
        return bytes(self.store.get(name))

    def size_of(self, name: str) -> int:
        """The stored value's size in bytes; -1 when the store cannot say (absent, or
        the master or segment did not answer)."""
        size = int(self.store.get_size(name))
        return size if size >= 0 else -1

    def exists(self, names: Sequence[str]) -> list[int]:
        return list(self.store.batch_is_exist(list(names)))

    def remove(self, names: Sequence[str]) -> list[int]:
        """Remove even objects under a lease: the cache asked (or the frame failed its
        check), and a reader elsewhere that loses the race reads a failed check or a
        miss, never wrong bytes (its frame is checked)."""
        return list(self.store.batch_remove(list(names), True))

    def close(self) -> None:
        for address in self._registered:
            self.store.unregister_buffer(address)
        self._registered.clear()
        self.store.close()
