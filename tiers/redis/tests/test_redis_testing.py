"""The test servers themselves (`tierkv_redis.testing`): a port another process took
between `free_port` and the server's bind is not a failed test, it is a new port."""

from __future__ import annotations

import socket
from pathlib import Path

from tierkv_redis.testing import RedisServer


def test_a_first_start_whose_port_was_taken_moves_to_a_free_one(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))  # held (not listening: nothing answers on it)
        server = RedisServer(tmp_path)
        server.port = taken.getsockname()[1]  # as if another process won the race
        try:
            server.start()
            assert server.port != taken.getsockname()[1]
            assert server.running
            assert server._command("PING") == b"+PONG\r\n"
            port = server.port
            server.stop()
            server.start()  # a restart keeps its port
            assert server.port == port
        finally:
            server.close()
