"""A real `redis-server` for tests and benchmarks: loopback only, persistence off.

    with RedisServer(tmp_path) as server:
        config = RedisTierConfig(url=server.url)

The server runs as a child process on a free port of 127.0.0.1 in its own directory.
`stop` kills it and `start` brings it back on the same port (empty: nothing is
persisted), `freeze`/`thaw` suspend it (SIGSTOP/SIGCONT) to play a server that
accepts connections but never answers. `cluster=True` makes it a one-node Redis
Cluster that owns every slot; `tls=True` serves TLS only (`rediss://`), with a
self-signed certificate for 127.0.0.1 made by the `openssl` command (`ca_file`).

`HandshakePeer` is no Redis at all: a loopback listener that lets redis-py connect and
then does what a test says (answers a command wrongly, stops reading mid-command).

`RedisClusterServers` starts a real Redis Cluster of several masters (and replicas, if
asked) sharing the slots, any node of which can be killed and restarted:

    with RedisClusterServers(tmp_path, masters=3) as cluster:
        config = RedisTierConfig(url=cluster.url, cluster=True)
        cluster.kill(1)       # SIGKILL master 1
        cluster.restart(1)    # empty, same port and node id: owns its slots again
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

from tierkv.testing.servers import LocalServer, free_port

INSTALL_HINT = "install it with `apt-get install redis-server` (Debian/Ubuntu)"


class RedisServerMissing(RuntimeError):
    """No `redis-server` binary on PATH (or, for TLS, no `openssl`)."""


START_ATTEMPTS = 3
"""First starts of a test server tried on fresh ports when its port was taken."""


class _PortTaken(RuntimeError):
    """redis-server could not bind its port: another process took it first."""


def _port_was_taken(log: Path, since: int) -> bool:
    """Whether what a server wrote to its log after byte `since` says its port was in
    use."""
    try:
        with open(log, "rb") as f:
            f.seek(since)
            told = f.read(1 << 16)
    except OSError:
        return False
    return b"Address already in use" in told


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
        cluster_member: bool = False,
    ) -> None:
        self._binary = redis_server_binary()
        # with cluster=True: a node of a larger cluster, which `RedisClusterServers`
        # joins and gives slots; it keeps its identity (nodes.conf) across restarts, so
        # a restarted node rejoins by itself, with its slots or as the same replica
        self.cluster_member = cluster_member
        self._started = False
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
        """Start (or restart, on the same port) and wait until it answers. A first
        start whose port another process took between `free_port` and the bind (the
        log says "Address already in use") tries new ports, up to START_ATTEMPTS."""
        for attempt in range(START_ATTEMPTS):
            try:
                self._start_once()
                return
            except _PortTaken:
                if self._started or attempt == START_ATTEMPTS - 1:
                    raise
                self.port = free_port()
                if self.cluster_port is not None:
                    self.cluster_port = free_port()

    def _start_once(self) -> None:
        if self.running:
            return
        if self.cluster and not (self.cluster_member and self._started):
            (self.directory / "nodes.conf").unlink(missing_ok=True)
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - child keeps it
        since = log.tell()
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
                why = (
                    f"redis-server exited with {self._process.returncode} on port "
                    f"{self.port}; see {self.directory / 'redis.log'}"
                )
                if _port_was_taken(self.directory / "redis.log", since):
                    raise _PortTaken(why)
                raise RuntimeError(why)
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not come up")
            time.sleep(0.02)
        self._started = True
        if self.cluster and not self.cluster_member:
            self._claim_all_slots()

    def _command(self, *args: str) -> bytes:
        """Send one command with the inline protocol and return the raw reply (a bulk
        string reply whole, e.g. CLUSTER NODES; other kinds as the first read has it)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as raw:
            s = raw
            if self.tls:
                context = ssl.create_default_context(cafile=str(self.ca_file))
                s = context.wrap_socket(raw, server_hostname="127.0.0.1")
            if self.password is not None:
                s.sendall(f"AUTH {self.password}\r\n".encode())
                s.recv(1024)
            s.sendall((" ".join(args) + "\r\n").encode())
            reply = s.recv(65536)
            if reply.startswith(b"$") and b"\r\n" in reply:
                head, _, _ = reply.partition(b"\r\n")
                whole = len(head) + 2 + max(0, int(head[1:])) + 2
                while len(reply) < whole:
                    more = s.recv(65536)
                    if not more:
                        break
                    reply += more
            return reply

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


class RedisClusterServers(LocalServer):
    """A real Redis Cluster on loopback: `masters` masters sharing the 16384 slots in
    equal ranges, each with `replicas` replicas; every node a `RedisServer` in its own
    directory (`servers`: the masters first, then master 0's replicas, master 1's, ...).

    Set up as a deployment that should lose only a dead node's keys:
    `cluster-require-full-coverage no` (the live masters keep serving while a dead
    master's slots have no live owner) and a short `cluster-node-timeout` (failures,
    failovers and returns are noticed within a few seconds).

    `kill(i)` SIGKILLs node i; `restart(i)` starts it again on its port, empty but with
    its node id (its nodes.conf), so a master rejoins owning its slots and a replica
    follows its master again. A replica of a killed master takes its slots over by
    itself after about two node timeouts (Redis's own failover).
    """

    NODE_TIMEOUT_MS = 1000

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        masters: int = 3,
        *,
        replicas: int = 0,
        start_timeout: float = 30.0,
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError(f"need masters >= 1 and replicas >= 0, got {masters}, {replicas}")
        self._own_dir = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="tierkv-redis-cluster-"))
        self.start_timeout = start_timeout
        cut = [i * 16384 // masters for i in range(masters + 1)]
        self.slot_ranges = [(cut[i], cut[i + 1] - 1) for i in range(masters)]
        args = (
            "--cluster-node-timeout", str(self.NODE_TIMEOUT_MS),
            "--cluster-require-full-coverage", "no",
            "--repl-diskless-sync-delay", "0",  # a replica syncs at once, not after 5 s
            # a replica is in CLUSTER SLOTS once it has a replication offset: ping it
            # every second rather than every 10
            "--repl-ping-replica-period", "1",
        )  # fmt: skip
        self.servers: list[RedisServer] = []
        self.master_of: list[int | None] = []  # per node: the master it replicates
        for i in range(masters * (1 + replicas)):
            path = self.directory / f"node{i}"
            path.mkdir(parents=True, exist_ok=True)
            self.servers.append(
                RedisServer(path, cluster=True, cluster_member=True, extra_args=args)
            )
            self.master_of.append(None if i < masters else (i - masters) // replicas)
        self.node_ids: list[str] = []

    @property
    def masters(self) -> list[RedisServer]:
        return [s for s, master in zip(self.servers, self.master_of) if master is None]

    @property
    def url(self) -> str:
        """redis://127.0.0.1:PORT of master 0."""
        return self.servers[0].url

    def start(self) -> None:
        """Start every node, join them, give the masters their slots and the replicas
        their masters; return once every node says cluster_state:ok."""
        for server in self.servers:
            server.start()
        self.node_ids = [_reply_text(s._command("CLUSTER", "MYID")) for s in self.servers]
        first = self.servers[0]
        for server in self.servers[1:]:
            port, bus = str(server.port), str(server.cluster_port)
            _expect_ok(first._command("CLUSTER", "MEET", "127.0.0.1", port, bus))
        for server, (lo, hi) in zip(self.masters, self.slot_ranges):
            _expect_ok(server._command("CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi)))
        for server, master in zip(self.servers, self.master_of):
            if master is not None:
                self._replicate(server, self.node_ids[master])
        self.wait_ok()

    def _replicate(self, replica: RedisServer, master_id: str) -> None:
        def met() -> bool:
            return master_id.encode() in replica._command("CLUSTER", "NODES")

        self._until(met, f"node {replica.port} never met its master {master_id}")
        _expect_ok(replica._command("CLUSTER", "REPLICATE", master_id))

    def _until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster on {self.directory}: {what}")
            time.sleep(0.05)

    def wait_ok(self) -> None:
        """Until every running node says cluster_state:ok and every running replica
        (whatever its role was at the start: failovers swap them) has its link to its
        master up."""

        def ok() -> bool:
            running = [(i, s) for i, s in enumerate(self.servers) if s.running]
            ports = {s.port for _i, s in running}
            truth = set()
            for i, server in running:
                if b"cluster_state:ok" not in server._command("CLUSTER", "INFO"):
                    return False
                info = server._command("INFO", "replication")
                if b"role:slave" in info and b"master_link_status:up" not in info:
                    return False
                truth.add((self.node_ids[i], "slave" if b"role:slave" in info else "master"))
            # and every node sees the others as they are, and lists each in the slot
            # map (a client asking any of them gets the whole truth)
            return all(
                _cluster_view(server) == truth and _slot_map_ports(server) == ports
                for _i, server in running
            )

        self._until(ok, "never reached cluster_state:ok on every node")

    def kill(self, i: int) -> None:
        """SIGKILL node `i` (its data is gone: persistence is off)."""
        self.servers[i].stop()

    def restart(self, i: int, *, wait: bool = True) -> None:
        """Start node `i` again on its port, empty, with its node id; with `wait`,
        return once the cluster is whole again (else as soon as the node answers)."""
        self.servers[i].start()
        if wait:
            self.wait_ok()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def close(self) -> None:
        for server in self.servers:
            server.close()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


def _reply_text(reply: bytes) -> str:
    """The text of a simple or bulk string reply."""
    lines = reply.split(b"\r\n")
    return (lines[1] if reply.startswith(b"$") else lines[0][1:]).decode()


def _cluster_view(server: RedisServer) -> set[tuple[str, str]]:
    """(node id, master or slave) of each node `server` believes is up."""
    _length, _, text = server._command("CLUSTER", "NODES").decode().partition("\r\n")
    view = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        flags = set(fields[2].split(","))
        if not flags & {"fail", "fail?", "noaddr", "handshake"}:
            view.add((fields[0], "slave" if "slave" in flags else "master"))
    return view


def _slot_map_ports(server: RedisServer) -> set[int]:
    """The port of every node in the CLUSTER SLOTS reply of `server`."""
    client = redis.Redis(port=server.port, socket_timeout=2)
    try:
        reply = client.execute_command("CLUSTER SLOTS")  # type: ignore[no-untyped-call]
    finally:
        client.close()
    return {int(node[1]) for entry in reply for node in entry[2:]}


def _expect_ok(reply: bytes) -> None:
    if not reply.startswith(b"+OK"):
        raise RuntimeError(f"redis cluster setup: expected OK, got {reply!r}")


class HandshakePeer:
    """A loopback listener standing in for a Redis that misbehaves, for one client
    connection: it answers redis-py's connection handshake (CLIENT SETINFO: OK; the
    client must use `protocol=2`) until a chunk the client sends holds `marker` (the
    command under test), then hands the connection to `then(conn, rest)`, `rest`
    being that chunk from the marker on. `close()` closes the listener and the
    connection."""

    def __init__(self, marker: bytes, then: Callable[[socket.socket, bytes], None]) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._marker = marker
        self._then = then
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:  # closed before any client came
            return
        self._conns.append(conn)
        while True:
            data = conn.recv(65536)
            if not data:
                return
            conn.sendall(b"+OK\r\n" * data.count(b"SETINFO"))
            at = data.find(self._marker)
            if at >= 0:
                self._then(conn, data[at:])
                return

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for `then` to return."""
        self._thread.join(timeout)

    def close(self) -> None:
        self._listener.close()
        for conn in self._conns:
            conn.close()
