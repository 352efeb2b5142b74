"""A real Mooncake Store for tests and benchmarks: `mooncake_master` on free loopback
ports with its HTTP metadata server (`MooncakeMaster`), and a second process that
mounts a segment (`SegmentHolder`), so blocks a tier stores live in another process's
memory, as on a fleet.

Test scaffolding, not runtime; no pytest needed. `python -m tierkv_mooncake.testing
hold MASTER METADATA SIZE` is the holder process itself; `python -m
tierkv_mooncake.testing serve SIZE` starts a master and a holder of SIZE bytes for a
benchmark, prints the tier's YAML fields and runs until its input closes (Ctrl-D) or
it is interrupted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tierkv.testing.servers import LocalServer, free_port

INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (requirements-dev.txt) "
    "and apt-get install libibverbs1 librdmacm1 libnuma1 (scripts/setup-servers.sh)"
)


class MooncakeMissing(RuntimeError):
    """The binding, its system libraries or `mooncake_master` is not installed."""


def mooncake_master_binary() -> str:
    """The `mooncake_master` of this Python's environment; MooncakeMissing otherwise
    (also when the binding cannot load its system libraries)."""
    try:
        import mooncake.store  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as exc:
        raise MooncakeMissing(f"cannot import mooncake.store ({exc}); {INSTALL_HINT}") from None
    beside = Path(sys.executable).parent / "mooncake_master"
    path = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if path is None:
        raise MooncakeMissing(f"mooncake_master is not installed; {INSTALL_HINT}")
    return path


def _wait_for_port(port: int, deadline: float, process: subprocess.Popen[bytes], log: Path) -> None:
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"the process exited ({process.returncode}): {log.read_text()[-2000:]}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.05)


class MooncakeMaster(LocalServer):
    """One `mooncake_master` child process on 127.0.0.1 with its HTTP metadata server.
    `restart()` starts it again on the same ports (empty: a master keeps no state);
    `kill()` ends it with SIGKILL. `client_ttl` (s) is how soon the master forgets a
    client (and its segment) that stopped sending heartbeats; `lease_ttl` (ms) how long
    an object read or written stays unevictable."""

    def __init__(
        self,
        *,
        client_ttl: int = 2,
        lease_ttl_ms: int = 10_000,
        extra_args: tuple[str, ...] = (),
        start_timeout: float = 20.0,
    ) -> None:
        self._binary = mooncake_master_binary()
        self.port = free_port()
        self.metadata_port = free_port()
        self.metrics_port = free_port()
        self.client_ttl = client_ttl
        self.lease_ttl_ms = lease_ttl_ms
        self.extra_args = extra_args
        self.start_timeout = start_timeout
        self.directory = Path(tempfile.mkdtemp(prefix="tierkv-mooncake-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        if self.running:
            return
        log = self.directory / "master.log"
        args = [
            self._binary,
            f"--rpc_port={self.port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_port={self.metrics_port}",
            "--enable_metric_reporting=false",
            f"--client_ttl={self.client_ttl}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            *self.extra_args,
        ]
        with open(log, "ab") as out:
            self._process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        _wait_for_port(self.port, deadline, self._process, log)
        _wait_for_port(self.metadata_port, deadline, self._process, log)

    def kill(self) -> None:
        """SIGKILL: no goodbye to anyone."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class SegmentHolder(LocalServer):
    """A separate process that mounts `segment_size` bytes of its memory into the
    store and then only waits: what another node of a fleet lends. `kill()` ends it
    with SIGKILL (its objects go with it); it also ends when this process does."""

    def __init__(
        self, master: MooncakeMaster, segment_size: int, start_timeout: float = 30.0
    ) -> None:
        self.master = master
        self.segment_size = segment_size
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        if self.running:
            return
        log = self.master.directory / f"holder-{os.getpid()}-{time.monotonic_ns()}.log"
        args = [
            sys.executable, "-m", "tierkv_mooncake.testing", "hold",
            self.master.master, self.master.metadata_server, str(self.segment_size),
        ]  # fmt: skip
        with open(log, "wb") as out:
            self._process = subprocess.Popen(
                args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out
            )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()  # the holder says "ready" once mounted
        if line.strip() != b"ready":
            self.kill()
            raise RuntimeError(f"the segment holder did not start: {log.read_text()[-2000:]}")

    def kill(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)  # a frozen process dies as well
            process.send_signal(signal.SIGKILL)
            process.wait()

    def freeze(self) -> None:
        """SIGSTOP: the process holds its segment and answers nothing (a hung node)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)
            assert process.stdin is not None
            process.stdin.close()  # the holder closes its store and exits
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _hold(master: str, metadata: str, segment_size: int) -> int:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", metadata, segment_size, 16 << 20, "tcp", "", master)
    if code != 0:
        print(f"setup failed: {code}", file=sys.stderr)
        return 1
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes the pipe (or dies)
    store.close()
    return 0


def _serve(segment_size: int) -> int:
    with MooncakeMaster() as master, SegmentHolder(master, segment_size):
        print(
            f"{{type: mooncake, master: '{master.master}', "
            f"metadata_server: '{master.metadata_server}'}}",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            sys.stdin.read()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "hold":
        sys.exit(_hold(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        sys.exit(_serve(int(sys.argv[2])))
    sys.exit(
        "usage: python -m tierkv_mooncake.testing hold MASTER METADATA SEGMENT_SIZE\n"
        "       python -m tierkv_mooncake.testing serve SEGMENT_SIZE"
    )
