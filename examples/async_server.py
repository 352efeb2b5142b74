"""A small asyncio HTTP server that serves completions from the demo model with a
`TieredCache` in its event loop (standard library only, plus tierkv).

    python examples/async_server.py                       # primary + nvme in a temp dir
    python examples/async_server.py --config examples/chains/embedded.yaml --port 8000
                                       # nvme under ~/.cache/tierkv/nvme ($TIERKV_NVME_PATH)

    curl -s localhost:8000/v1/completions -d '{"prompt": [1, 2, 3], "max_tokens": 4}'
    curl -s localhost:8000/v1/completions -d '{"prompt": "any text", "max_tokens": 4}'
    curl -s localhost:8000/stats        # TieredCache.stats()
    curl -s localhost:8000/metrics      # Prometheus, when prometheus-client is installed

Requests run concurrently: each one hashes its prompt's blocks, looks them up, loads
the hit blocks into its KV-cache blocks through the transfer worker, prefills the rest,
decodes, and stores its full blocks back; the model runs one forward pass at a time in
a worker thread, so the loop stays free for the cache's background jobs. Requests that
share a prefix (a system prompt, an earlier turn) reuse each other's blocks.

A text prompt is tokenized as its UTF-8 bytes (the weights are random: the point is
the KV cache, not the words). The server prints `listening on http://HOST:PORT` once
it accepts connections, and shuts down cleanly on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

from tierkv import CacheConfig, TieredCache, load_config, parse_config
from tierkv.demo import DemoEngine, ModelConfig, build_engine

MAX_BODY = 1 << 20


def default_chain(directory: str) -> CacheConfig:
    """Primary plus an nvme tier under `directory` (layout and namespace: the engine's)."""
    return parse_config(
        {
            "namespace": "placeholder",
            "layout": {"block_bytes": "256KiB", "groups": [{"block_size": 32}]},
            "primary": {"capacity": "16MiB", "eviction": "arc"},
            "tiers": [{"type": "nvme", "path": f"{directory}/nvme", "capacity": "1GiB"}],
        }
    )


class CompletionServer:
    def __init__(self, engine: DemoEngine, cache: TieredCache) -> None:
        self.engine = engine
        self.cache = cache
        self.vocab = engine.model.config.vocab
        self.metrics: Any = None
        with contextlib.suppress(ImportError):  # /metrics needs prometheus-client
            from prometheus_client import generate_latest

            from tierkv.metrics import registry_for

            registry = registry_for(cache)
            self.metrics = lambda: generate_latest(registry)

    # -- endpoints ------------------------------------------------------------------------
    async def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            tokens = list(prompt.encode("utf-8"))
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            tokens = prompt
        else:
            return 400, {"error": "prompt must be a string or a list of token ids"}
        if not tokens or any(not 0 <= t < self.vocab for t in tokens):
            return 400, {"error": f"prompt must be non-empty, token ids in [0, {self.vocab})"}
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= 256:
            return 400, {"error": "max_tokens must be an integer in [1, 256]"}
        try:
            result = await self.engine.generate(tokens, max_tokens)
        except ValueError as exc:  # e.g. longer than the KV cache can ever hold
            return 400, {"error": str(exc)}
        return 200, {
            "tokens": result.tokens,
            "prompt_tokens": result.prompt_tokens,
            "reused_tokens": result.reused_tokens,
            "sources": result.sources,
            "ttft_ms": round(result.ttft * 1e3, 3),
            "total_ms": round(result.total * 1e3, 3),
        }

    async def route(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        if path == "/v1/completions" and method == "POST":
            try:
                request = json.loads(body or b"{}")
            except json.JSONDecodeError as exc:
                return _json(400, {"error": f"invalid JSON: {exc}"})
            if not isinstance(request, dict):
                return _json(400, {"error": "expected a JSON object"})
            return _json(*await self.complete(request))
        if path == "/stats" and method == "GET":
            return _json(200, self.cache.stats().as_dict())
        if path == "/metrics" and method == "GET" and self.metrics is not None:
            return 200, "text/plain; version=0.0.4; charset=utf-8", self.metrics()
        if path == "/healthz" and method == "GET":
            return _json(200, {"ok": True})
        return _json(404, {"error": f"no route for {method} {path}"})

    # -- HTTP/1.1, one request per connection ----------------------------------------------
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, body = await _read_request(reader)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            status, ctype, payload = _json(400, {"error": "malformed HTTP request"})
        else:
            try:
                status, ctype, payload = await self.route(method, path, body)
            except Exception as exc:  # a bug: answer 500, keep serving
                status, ctype, payload = _json(500, {"error": f"{type(exc).__name__}: {exc}"})
        writer.write(
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode("latin-1")
            + payload
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    """Method, path and body of one HTTP/1.1 request (ValueError if malformed)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, target, _ = request_line.split(" ", 2)
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in header_lines if line)
    }
    length = int(headers.get("content-length", "0"))
    if not 0 <= length <= MAX_BODY:
        raise ValueError(f"body of {length} bytes")
    body = await reader.readexactly(length) if length else b""
    return method, target.split("?")[0], body


def _json(status: int, data: Any) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(data).encode()


@contextlib.asynccontextmanager
async def serving(args: argparse.Namespace) -> AsyncIterator[CompletionServer]:
    """The engine, its cache (opened in this loop) and the HTTP handler."""
    model = ModelConfig(hidden=args.hidden, layers=args.layers, heads=args.heads)
    engine = build_engine(model, gpu_blocks=args.gpu_blocks)
    with tempfile.TemporaryDirectory(prefix="tierkv-server-") as tmp:
        chain = load_config(args.config) if args.config else default_chain(tmp)
        # the KV geometry and the model decide the layout and the namespace
        config = chain.model_copy(update={"layout": engine.layout, "namespace": engine.namespace})
        for name, tier in zip(config.tier_names(), config.tiers):
            where = getattr(tier, "path", None)
            if where is not None:  # say where this server writes (stderr: a log line)
                print(f"tier {name} keeps its blocks under {where}", file=sys.stderr, flush=True)
        async with TieredCache(config) as cache:
            engine.attach(cache)
            yield CompletionServer(engine, cache)


async def main(args: argparse.Namespace) -> None:
    async with serving(args) as app:
        server = await asyncio.start_server(app.handle, args.host, args.port)
        host, port = server.sockets[0].getsockname()[:2]
        print(f"listening on http://{host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with server:
            await stop.wait()
        print("shutting down: finishing the cache's background writes", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--config", type=Path, help="YAML tier chain")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--gpu-blocks", type=int, default=512, help="KV cache blocks of 16")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
