"""Local helper servers for tests and benchmarks (a redis-server, moto's S3 server, a
fault-injecting proxy): a free loopback port, and one start/stop/`with` life cycle.

Kept apart from `tierkv.testing` so benchmark scripts can start servers without pytest.
"""

from __future__ import annotations

import socket
from types import TracebackType
from typing import TypeVar

_S = TypeVar("_S", bound="LocalServer")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """`with Server() as s:` starts it and always stops it; a failed start cleans up.

    Subclasses implement `start` and `stop` (both idempotent) and may extend `close`
    to remove what they left on disk."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop()

    def __enter__(self: _S) -> _S:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
