"""What the tier packages' test servers share (a redis-server, moto's S3 server, a
fault-injecting proxy): a free loopback port, and one start/stop/`with` life cycle.

Test scaffolding, not runtime: nothing in the cache imports it. It needs no pytest, so
benchmark scripts can start servers too.
"""

from __future__ import annotations

import os
import socket
from types import TracebackType
from typing import NoReturn, TypeVar

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


def missing_server(what: str, exc: BaseException) -> NoReturn:
    """A test needs a real server (`what`) that is not installed: under `CI=true` that
    is a failure (CI must install it), elsewhere a skip with the reason."""
    import pytest  # only tests call this; servers stay usable without pytest

    reason = f"needs {what}: {exc}"
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{reason} (CI=true: a missing server is a failure, not a skip)")
    pytest.skip(reason)
