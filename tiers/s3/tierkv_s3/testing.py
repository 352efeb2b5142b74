"""A real S3 API for tests and benchmarks, and a proxy that injects faults into it.

    with MotoServer() as s3, FaultProxy(s3.endpoint_url) as proxy:
        s3.create_bucket("kv")
        config = S3TierConfig(url="s3://kv/p", endpoint_url=proxy.url, ...)
        proxy.inject(Fault(match=key.hex(), status=503, code="SlowDown", times=2))

`MotoServer` runs moto's standalone server (`python -m moto.server`) as a child
process on a free port of 127.0.0.1: real HTTP, a real S3 wire protocol, no mocking of
the client. `FaultProxy` forwards every request to it unchanged unless a `Fault`
matches the request path: then it answers an S3 error (503 SlowDown, 500 ...), drops
the connection, or waits before answering. `stop`/`start` on the proxy play an
endpoint that goes away (connections refused and live ones cut) and comes back.
Loopback only.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from tierkv.testing.servers import LocalServer, free_port

INSTALL_HINT = "install it with `pip install 'moto[server]'`"
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te"}


class MotoMissing(RuntimeError):
    """moto's server (or flask, which it needs) is not installed."""


def _wait_for_http(url: str, timeout: float, alive: Callable[[], bool] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            if alive is not None and not alive():
                raise RuntimeError(f"the server behind {url} exited") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing answered at {url} within {timeout}s") from None
            time.sleep(0.05)


class MotoServer(LocalServer):
    """moto's S3 server as a child process on 127.0.0.1."""

    def __init__(self, *, start_timeout: float = 30.0) -> None:
        for module in ("moto", "flask", "flask_cors"):  # what `moto.server` imports
            if importlib.util.find_spec(module) is None:
                raise MotoMissing(f"{module} is not importable; {INSTALL_HINT}")
        self.port = free_port()
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="tierkv-moto-", suffix=".log")[1])

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        with open(self._log, "ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        process = self._process
        try:
            _wait_for_http(
                f"{self.endpoint_url}/moto-api/", self.start_timeout, lambda: process.poll() is None
            )
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"moto server did not start ({exc}); log: {self._log}") from None

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait(timeout=10)

    def create_bucket(self, name: str) -> None:
        """PUT /<name> (moto accepts it unsigned)."""
        request = urllib.request.Request(f"{self.endpoint_url}/{name}", method="PUT")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def delete_bucket(self, name: str) -> None:
        request = urllib.request.Request(f"{self.endpoint_url}/{name}", method="DELETE")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def close(self) -> None:
        self.stop()
        self._log.unlink(missing_ok=True)


@dataclass
class Fault:
    """What to do to requests whose path contains `match` (and whose method is in
    `methods`, if given): answer `status`/`code`, `drop` the connection, or `delay`
    seconds and then forward. `times` limits how many requests it hits (None: all)."""

    match: str
    action: Literal["error", "drop", "delay"] = "error"
    status: int = 503
    code: str = "SlowDown"
    message: str = "Please reduce your request rate."
    delay: float = 0.0
    methods: frozenset[str] | None = None
    times: int | None = None
    hits: int = field(default=0, init=False)
    forwarded: int = field(default=0, init=False)
    """Requests it delayed that have since been passed on (the server has them)."""

    def applies(self, method: str, path: str) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.methods is not None and method not in self.methods:
            return False
        return self.match in path


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes
    server: _Server
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        self.server.proxy._track(self.connection, True)

    def finish(self) -> None:
        self.server.proxy._track(self.connection, False)
        if self._upstream is not None:
            self._upstream.close()
        with contextlib.suppress(OSError):
            super().finish()

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        try:
            body = self._body()
            fault = self.server.proxy._record(self.command, self.path)
            if fault is not None and fault.action == "drop":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if fault is not None and fault.action == "delay":
                time.sleep(fault.delay)
                try:
                    self._forward(body)
                finally:
                    fault.forwarded += 1
                return
            if fault is not None and fault.action == "error":
                self._send_error(fault)
                return
            self._forward(body)
        except OSError:  # the client went away (it timed out, or we dropped it)
            self.close_connection = True

    def _send_error(self, fault: Fault) -> None:
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{fault.code}</Code><Message>{fault.message}</Message>"
            "<RequestId>tierkv-fault</RequestId></Error>"
        ).encode()
        self.send_response(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(xml)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(xml)

    def _exchange(self, body: bytes) -> tuple[http.client.HTTPResponse, bytes]:
        """Send the request upstream on this client connection's own keep-alive
        connection (a fresh one if the old one was closed) and read the answer."""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        for attempt in (0, 1):
            if self._upstream is None:
                upstream = self.server.proxy.upstream
                self._upstream = http.client.HTTPConnection(
                    upstream.hostname or "127.0.0.1", upstream.port, timeout=60
                )
            try:
                self._upstream.request(self.command, self.path, body=body, headers=headers)
                response = self._upstream.getresponse()
                return response, response.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._upstream.close()
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _forward(self, body: bytes) -> None:
        response, data = self._exchange(body)
        self.send_response(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        length = response.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle


class FaultProxy(LocalServer):
    """An HTTP proxy on 127.0.0.1 in front of an S3 endpoint, with injectable faults."""

    def __init__(self, upstream_url: str) -> None:
        self.upstream = urlsplit(upstream_url)
        if self.upstream.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the fault proxy only forwards to loopback addresses")
        self.port = free_port()
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request seen
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self.requests.clear()

    def count(self, match: str, method: str | None = None) -> int:
        """Requests seen whose path contains `match` (and of `method`, if given)."""
        with self._lock:
            return sum(
                1 for m, p in self.requests if match in p and (method is None or m == method)
            )

    def _record(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.requests.append((method, path))
            for fault in self._faults:
                if fault.applies(method, path):
                    fault.hits += 1
                    return fault
        return None

    def _track(self, connection: socket.socket, alive: bool) -> None:
        with self._lock:
            if alive:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)

    def start(self) -> None:
        if self._server is not None:
            return
        server = _Server(("127.0.0.1", self.port), _Handler)
        server.proxy = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening and cut every live connection: the endpoint is gone."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self._lock:
            live = list(self._connections)
        for connection in live:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)
