"""The trace format: Mooncake's JSONL (FAST'25 release, `traces/`), one request per line:

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, 2]}

`timestamp` is the arrival in milliseconds from the start, `input_length` and
`output_length` are tokens, and `hash_ids` name the prompt's blocks of 512 tokens in
order (two requests whose prompts share a prefix share its leading ids). A block's
tierkv key chains the ids up to it (`request_keys`), so equal prefixes give equal
keys and a block's key names its whole prefix.

tierkv adds one optional field, `"tenant": "acme"`: who the request serves (a
non-empty string; absent or null: the default tenant). A replay passes it to the cache
as `ReqContext.tenant`, so per-tenant counts and quotas see it. It does not change the
keys: two tenants sending the same `hash_ids` ask for the same blocks, a prefix they
share (a trace keeps tenants' prompts apart by giving them different ids). Mooncake's
own traces have no tenant.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key

TRACE_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` entry in the Mooncake traces."""


class TraceError(ValueError):
    """A trace line that is not a request (the message names the file and line)."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str | None = None


def _request(data: object, where: str) -> TraceRequest:
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(data).__name__}")
    missing = [k for k in ("timestamp", "input_length", "hash_ids") if k not in data]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    ids = data["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    stamp, length = data["timestamp"], data["input_length"]
    if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or stamp < 0:
        raise TraceError(f"{where}: timestamp must be a non-negative number of ms")
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise TraceError(f"{where}: input_length must be a non-negative integer")
    out = data.get("output_length", 0)
    if not isinstance(out, int) or isinstance(out, bool) or out < 0:
        raise TraceError(f"{where}: output_length must be a non-negative integer")
    tenant = data.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant.strip()):
        raise TraceError(
            f'{where}: tenant must be a non-empty string (a name such as "acme"), '
            f"got {json.dumps(tenant)}; leave it out for the default tenant"
        )
    return TraceRequest(float(stamp), length, out, tuple(ids), tenant)


def iter_trace(path: str | Path, limit: int | None = None) -> Iterator[TraceRequest]:
    """The requests of the JSONL trace at `path`, in file order (blank lines skipped)."""
    p = Path(path)
    try:
        f = p.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{p}: {exc.strerror or exc}") from None
    with f:
        n = 0
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{number}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc.msg})") from None
            yield _request(data, where)
            n += 1
            if limit is not None and n >= limit:
                return


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Every request of the trace (the first `limit`); an empty trace is an error."""
    requests = list(iter_trace(path, limit))
    if not requests:
        raise TraceError(f"{path}: no requests")
    return requests


def request_keys(request: TraceRequest, namespace: str = "trace") -> list[OffloadKey]:
    """The request's block keys: its `hash_ids` chained, one key per trace block (its
    tenant plays no part: equal ids give equal keys whoever sends them)."""
    hashes = hash_token_blocks(list(request.hash_ids), 1, namespace=namespace)
    return [make_offload_key(h, 0) for h in hashes]
