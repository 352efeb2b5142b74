"""A real `redis-server` for tests and benchmarks: loopback only, persistence off.

    with RedisServer(tmp_path) as server:
        config = RedisTierConfig(url=server.url)

The server runs as a child process on a free port of 127.0.0.1 in its own directory.
`stop` kills it and `start` brings it back on the same port (empty: nothing is
persisted), `freeze`/`thaw` suspend it (SIGSTOP/SIGCONT) to play a server that
accepts connections but never answers. `cluster=True` makes it a one-node Redis
Cluster that owns every slot (`RedisClusterServers` starts several masters that share
the slots, each of which can be killed and restarted); `tls=True` serves TLS only
(`rediss://`), with a self-signed certificate for 127.0.0.1 made by the `openssl`
command (`ca_file`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

from tierkv.testing.servers import LocalServer, free_port

INSTALL_HINT = "install it with `apt-get install redis-server` (Debian/Ubuntu)"


class RedisServerMissing(RuntimeError):
    """No `redis-server` binary on PATH (or, for TLS, no `openssl`)."""


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RedisServerMissing(f"redis-server is not on PATH; {INSTALL_HINT}")
    return path


class RedisServer(LocalServer):
    """One `redis-server` child process on 127.0.0.1."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        password: str | None = None,
        cluster: bool = False,
        tls: bool = False,
        extra_args: tuple[str, ...] = (),
        start_timeout: float = 10.0,
        cluster_slots: tuple[int, int] | None = None,
    ) -> None:
        self._binary = redis_server_binary()
        # with a slot range: one master of a larger cluster, which keeps its identity
        # (nodes.conf) across restarts and so rejoins by itself
        self.cluster_slots = cluster_slots
        self._joined = False
        self._own_dir = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="tierkv-redis-"))
        self.password = password
        self.cluster = cluster
        self.tls = tls
        self.ca_file = self.directory / "tls-cert.pem"
        self._key_file = self.directory / "tls-key.pem"
        if tls:
            self._make_certificate()
        self.extra_args = extra_args
        self.start_timeout = start_timeout
        self.port = free_port()
        self.cluster_port = free_port() if cluster else None  # cluster bus (default port+10000)
        self._process: subprocess.Popen[bytes] | None = None
        self._frozen = False

    @property
    def url(self) -> str:
        """redis://127.0.0.1:PORT (db 0; a cluster URL names no db), or for TLS
        rediss://127.0.0.1:PORT/0?ssl_ca_certs=<the server's certificate>."""
        if self.tls:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca_file}"
        return f"redis://127.0.0.1:{self.port}" + ("" if self.cluster else "/0")

    def _make_certificate(self) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            raise RedisServerMissing("openssl is not on PATH; `apt-get install openssl`")
        self.directory.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                "-keyout", str(self._key_file), "-out", str(self.ca_file),
                "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
            ],
            check=True,
            capture_output=True,
        )  # fmt: skip

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _args(self) -> list[str]:
        args = [
            self._binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.tls:
            args[args.index("--port") + 1] = "0"  # no plaintext port at all
            args += ["--tls-port", str(self.port), "--tls-auth-clients", "no"]
            args += ["--tls-cert-file", str(self.ca_file), "--tls-key-file", str(self._key_file)]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-port", str(self.cluster_port)]
        return [*args, *self.extra_args]

    def start(self) -> None:
        """Start (or restart, on the same port) and wait until it answers."""
        if self.running:
            return
        if self.cluster and not self._joined:
            (self.directory / "nodes.conf").unlink(missing_ok=True)
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - child keeps it
        try:
            self._process = subprocess.Popen(
                self._args(), stdout=log, stderr=subprocess.STDOUT, cwd=self.directory
            )
        finally:
            log.close()
        self._frozen = False
        deadline = time.monotonic() + self.start_timeout
        while not self._answers():
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self._process.returncode} on port "
                    f"{self.port}; see {self.directory / 'redis.log'}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not come up")
            time.sleep(0.02)
        if self.cluster and not self._joined:
            if self.cluster_slots is None:
                self._claim_all_slots()
            else:
                lo, hi = self.cluster_slots
                reply = self._command("CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi))
                if not reply.startswith(b"+OK"):
                    raise RuntimeError(f"CLUSTER ADDSLOTSRANGE failed: {reply!r}")
                self._joined = True

    def _command(self, *args: str) -> bytes:
        """Send one command with the inline protocol and return the raw reply."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as raw:
            s = raw
            if self.tls:
                context = ssl.create_default_context(cafile=str(self.ca_file))
                s = context.wrap_socket(raw, server_hostname="127.0.0.1")
            if self.password is not None:
                s.sendall(f"AUTH {self.password}\r\n".encode())
                s.recv(1024)
            s.sendall((" ".join(args) + "\r\n").encode())
            return s.recv(65536)

    def _answers(self) -> bool:
        try:
            return self._command("PING").startswith(b"+PONG")
        except OSError:
            return False

    def _claim_all_slots(self) -> None:
        reply = self._command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        if not reply.startswith(b"+OK"):
            raise RuntimeError(f"CLUSTER ADDSLOTSRANGE failed: {reply!r}")
        deadline = time.monotonic() + self.start_timeout
        while b"cluster_state:ok" not in self._command("CLUSTER", "INFO"):
            if time.monotonic() > deadline:
                raise RuntimeError("the one-node cluster never reached cluster_state:ok")
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill the server (its data is gone: persistence is off)."""
        process, self._process = self._process, None
        if process is None:
            return
        process.kill()  # SIGKILL ends a frozen process too, without letting it run first
        self._frozen = False
        process.wait(timeout=10)

    def freeze(self) -> None:
        """Suspend the server: connections are accepted by the kernel, never answered."""
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)
            self._frozen = True

    def thaw(self) -> None:
        if self._process is not None and self._frozen:
            self._process.send_signal(signal.SIGCONT)
            self._frozen = False

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


class RedisClusterServers:
    """A Redis Cluster of `masters` masters without replicas on loopback, the slots
    split evenly; `kill(i)` and `restart(i)` one master (restarted empty, with its
    identity, so it rejoins and owns its slots again).

    Set up as a deployment that should lose only a dead node's keys:
    `cluster-require-full-coverage no` (live masters keep serving while a slot range
    has no owner) and a 1 s `cluster-node-timeout` (failure and return noticed fast).

        with RedisClusterServers(tmp_path) as cluster:
            config = RedisTierConfig(url=cluster.url, cluster=True)
    """

    NODE_TIMEOUT_MS = 1000

    def __init__(self, directory: str | os.PathLike[str], masters: int = 3) -> None:
        base = Path(directory)
        cut = [round(i * 16384 / masters) for i in range(masters + 1)]
        args = (
            "--cluster-node-timeout", str(self.NODE_TIMEOUT_MS),
            "--cluster-require-full-coverage", "no",
        )  # fmt: skip
        self.servers: list[RedisServer] = []
        for i in range(masters):
            (base / f"master{i}").mkdir(parents=True, exist_ok=True)
            self.servers.append(
                RedisServer(
                    base / f"master{i}",
                    cluster=True,
                    extra_args=args,
                    cluster_slots=(cut[i], cut[i + 1] - 1),
                )
            )

    @property
    def url(self) -> str:
        return self.servers[0].url

    def start(self) -> None:
        for server in self.servers:
            server.start()
        first = self.servers[0]
        for server in self.servers[1:]:
            first._command(
                "CLUSTER", "MEET", "127.0.0.1", str(server.port), str(server.cluster_port)
            )
        self.wait_ok()

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Until every running master says cluster_state:ok."""
        deadline = time.monotonic() + timeout
        while True:
            states = [s._command("CLUSTER", "INFO") for s in self.servers if s.running]
            if all(b"cluster_state:ok" in state for state in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster never reached cluster_state:ok")
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        self.servers[i].stop()

    def restart(self, i: int) -> None:
        """Start master `i` again (empty) and wait until the cluster is whole."""
        self.servers[i].start()
        self.wait_ok()

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def __enter__(self) -> RedisClusterServers:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
