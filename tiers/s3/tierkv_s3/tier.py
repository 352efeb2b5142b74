"""`s3`: framed KV blocks as objects in S3 or any S3-compatible store, through s3fs.

One object per block, `<prefix>/<namespace tag>/<key hex>`, holding the
`tierkv.contract.framing` header and the block bytes, written with one PUT (a
multipart upload for frames of at least 2 x `part_size`); S3 makes an object visible
only once it is whole; a multipart upload that fails or is cancelled is aborted
(`multipart.py`).
Bytes read back are untrusted: an object failing any frame check (checksum, and the
MAC when `mac_key_env` is set) fails its key, is deleted and `report_removed`; so is a
block a load finds gone (deleted behind the tier's back, a bucket lifecycle rule).
Nothing is ever unpickled.

A block's PUT or GET runs whole in a worker thread, framing or checking included,
through a synchronous botocore client (same credentials and settings as s3fs's): on the
event loop, aiohttp assembling 2 MiB bodies, botocore signing them and the frame's
checksum stalled every other request of the server by 14-88 ms per 64-block job. Each
attempt is bounded by `request_timeout` on the loop; a thread an attempt or the job's
deadline leaves behind is freed by its own socket timeouts (at most `request_timeout`)
and touches the job's slots only under the job's `SlotGuard`, which the job closes
before it returns.

s3fs runs in asynchronous mode on the caller's event loop for the rest (multipart
uploads of frames of at least 2 x `part_size`, HEAD, batched DELETE), with its listings
cache and its own retries off: `retry.call_with_retries` is the one retry policy. A
job moves its keys with up to `max_concurrency` requests at once (the contract's
`run_job`); a key that fails (throttled past `retries`, a 5xx, a timeout) fails alone
and the others go on. A failure that would fail every key alike (endpoint unreachable,
bucket gone, access denied) aborts the rest of the job at once.

Multipart stores, and the uploads a cancelled or timed-out one may leave at S3, are
`multipart.MultipartUploads`' (swept right after the store and again at `close`).

Lookups send one HEAD per key, concurrently, and trust a block this tier itself
stored or loaded for `exists_cache_ttl`; any failed load of a key forgets it, so a
block deleted behind the tier's back is reported absent from then on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anyio
import botocore.session  # type: ignore[import-untyped]
from aiobotocore.session import AioSession  # type: ignore[import-untyped]
from botocore.config import Config  # type: ignore[import-untyped]
from s3fs import S3FileSystem  # type: ignore[import-untyped]

from tierkv.tier import (
    Batch,
    CorruptBlock,
    ForeignBlock,
    InFlightJobs,
    IOThreads,
    JobAborted,
    JobMetadata,
    JobResult,
    OffloadKey,
    PrimaryView,
    ReqContext,
    SecondaryTierManager,
    SlotGuard,
    TierConfig,
    TierUnavailable,
    detached,
    in_thread,
    redact_url,
    run_job,
)
from tierkv_s3.config import S3TierConfig
from tierkv_s3.multipart import MultipartUploads
from tierkv_s3.names import ObjectNames
from tierkv_s3.retry import JOB_WIDE, S3Failure, call_with_retries

logger = logging.getLogger(__name__)

T = TypeVar("T")

_DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes
_PRESENT_MAX = 1 << 16  # entries of the existence cache

_FRAMING_THREADS = 2
"""Worker threads framing and checking blocks, per tier (more would only compete with
the event loop for the GIL while hashing and copying)."""

_SESSIONS: dict[str | None, AioSession] = {}
_SYNC_SESSIONS: dict[str | None, Any] = {}
_SYNC_SESSIONS_LOCK = threading.Lock()


def _shared_session(profile: str | None) -> AioSession:
    """One botocore session per profile for the process: a new session parses the S3
    service model again (~0.2-0.4 s); clients made from a shared one take ~10 ms.
    A session holds configuration and credential providers, no connections; each
    tier's client (and its connection pool) is its own and closed by `close()`."""
    session = _SESSIONS.get(profile)
    if session is None:
        session = _SESSIONS[profile] = AioSession(profile=profile)
    return session


def _shared_sync_session(profile: str | None) -> Any:
    """Worker thread: the synchronous botocore session of `profile`, one per process
    like `_shared_session` (a session is not safe to make clients from concurrently,
    hence the lock)."""
    with _SYNC_SESSIONS_LOCK:
        session = _SYNC_SESSIONS.get(profile)
        if session is None:
            session = _SYNC_SESSIONS[profile] = botocore.session.Session(profile=profile)
        return session


_PROBE_TIMEOUT = 5.0
"""At most this long (or `request_timeout`, if shorter) to learn whether an endpoint
answers, when the client has no credentials to ask it anything."""


async def probe_endpoint(url: str, timeout: float) -> str | None:
    """None when a TCP connection to `url`'s host and port is made within `timeout`;
    else why not. Botocore refuses to send a request it cannot sign, so without
    credentials this is the only way to tell an unreachable endpoint apart."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        return None  # nothing to probe: say nothing about it
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with anyio.fail_after(timeout):
            stream = await anyio.connect_tcp(host, port)
    except TimeoutError:
        return f"no answer from {host}:{port} within {timeout:g}s"
    except OSError as exc:
        cause = exc.__cause__  # anyio's "All connection attempts failed" wraps the last one
        reason = cause if isinstance(cause, OSError) else exc
        code = reason.errno if isinstance(reason.errno, int) and reason.errno > 0 else 0
        why = os.strerror(code) if code else reason.strerror or reason
        return f"cannot connect to {host}:{port}: {why}"
    await stream.aclose()
    return None


class JobEnded(Exception):
    """A worker thread found its job over before it touched the job's slot."""


class S3Tier(SecondaryTierManager):
    """Blocks as S3 objects: shared by every server that can reach the bucket."""

    Config = S3TierConfig
    config: S3TierConfig
    shared_storage = True
    accepts_regions = True  # a frame is built (a copy) anyway: regions are joined into it

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        super().__init__(config, primary)
        c = self.config
        self._names = ObjectNames(c.bucket, c.prefix, primary.namespace)
        self._endpoint = redact_url(c.endpoint_url) if c.endpoint_url else "AWS S3"
        self._fs: S3FileSystem | None = None
        self._client: Any = None  # the aiobotocore client s3fs made; closed by close()
        self._sync: Any = None  # botocore client of single PUTs and GETs, in worker threads
        # one worker thread per request in flight (a thread holds its connection);
        # made by open(), let go by close()
        self._threads: IOThreads | None = None
        self._gate: anyio.Semaphore | None = None
        self._present: OrderedDict[OffloadKey, float] = OrderedDict()
        self._multipart = MultipartUploads(
            self._names, int(c.part_size), c.max_concurrency, self._call
        )
        self._cpu = anyio.CapacityLimiter(_FRAMING_THREADS)
        self._inflight = InFlightJobs(self.name)

    @staticmethod
    def get_tier_type() -> str:
        return "s3"

    def __repr__(self) -> str:
        return f"S3Tier(s3://{self._names.bucket}/{self._names.root}/, {self._endpoint})"

    # -- life cycle -----------------------------------------------------------------
    def _config_kwargs(self) -> dict[str, Any]:
        c = self.config
        return {
            "connect_timeout": c.request_timeout,
            "read_timeout": c.request_timeout,
            "max_pool_connections": c.max_concurrency,
            "retries": {"total_max_attempts": 1},  # retry.py retries, not botocore
            # the frame carries its own checksum; skip botocore's CRC of every body
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        }

    def _make_sync_client(self) -> Any:
        """Worker thread: the synchronous botocore client of single PUTs and GETs. Its
        timeouts are at most `job_timeout`, so a thread left behind by a deadline is
        freed about when its job was."""
        c = self.config
        config_kwargs = self._config_kwargs()
        timeout = min(c.request_timeout, c.job_timeout)
        config_kwargs["connect_timeout"] = config_kwargs["read_timeout"] = timeout
        kwargs: dict[str, Any] = {"endpoint_url": c.endpoint_url, "config": Config(**config_kwargs)}
        if c.region:
            kwargs["region_name"] = c.region
        if c.access_key_id is not None and c.secret_access_key is not None:
            kwargs["aws_access_key_id"] = c.access_key_id
            kwargs["aws_secret_access_key"] = c.secret_access_key.get_secret_value()
            if c.session_token is not None:
                kwargs["aws_session_token"] = c.session_token.get_secret_value()
        session = _shared_sync_session(c.profile)
        with _SYNC_SESSIONS_LOCK:
            return session.create_client("s3", **kwargs)

    def _make_fs(self) -> S3FileSystem:
        c = self.config
        config_kwargs = self._config_kwargs()
        kwargs: dict[str, Any] = {}
        if c.access_key_id is not None and c.secret_access_key is not None:
            kwargs["key"] = c.access_key_id
            kwargs["secret"] = c.secret_access_key.get_secret_value()
            if c.session_token is not None:
                kwargs["token"] = c.session_token.get_secret_value()
        fs = S3FileSystem(
            session=_shared_session(c.profile),
            asynchronous=True,
            skip_instance_cache=True,  # never share a client (or a closed one) between tiers
            use_listings_cache=False,  # existence is asked of S3, not of a listing cache
            endpoint_url=c.endpoint_url,
            client_kwargs={"region_name": c.region} if c.region else {},
            config_kwargs=config_kwargs,
            max_concurrency=c.max_concurrency,
            **kwargs,
        )
        fs.retries = 1  # one attempt per s3fs call
        return fs

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        c = self.config
        return await call_with_retries(
            what,
            call,
            retries=c.retries,
            timeout=c.request_timeout,
            backoff_base=c.retry_backoff,
            backoff_cap=c.retry_backoff_max,
        )

    async def open(self) -> None:
        """Connect and check the bucket exists. Raises TierUnavailable, naming the
        bucket and endpoint, when it does not, access is denied, the endpoint is
        unreachable, or no credentials are found (saying whether the endpoint answers
        too); the tier may be opened again later."""
        if self._fs is not None:
            return
        self._inflight.closing = False
        fs = self._make_fs()
        try:
            client = await fs.set_session()
        except Exception as exc:  # e.g. a profile that does not exist
            raise TierUnavailable(
                f"cannot set up the S3 client for {self._endpoint}: {type(exc).__name__}: {exc}"
            ) from None
        bucket = self._names.bucket
        try:
            await self._call(
                f"bucket {bucket!r}", lambda: fs._call_s3("head_bucket", Bucket=bucket)
            )
        except S3Failure as failure:
            await client.close()
            if failure.kind in ("missing", "no_bucket"):
                raise TierUnavailable(
                    f"S3 bucket {bucket!r} does not exist at {self._endpoint}; "
                    "create it or fix the tier's `url`"
                ) from None
            if failure.kind == "no_credentials":
                raise TierUnavailable(await self._no_credentials(client, str(failure))) from None
            if failure.kind == "denied":
                raise TierUnavailable(
                    f"access to S3 bucket {bucket!r} at {self._endpoint} was denied "
                    f"({failure}); check the credentials ({self.config.credential_source})"
                ) from None
            raise TierUnavailable(f"S3 at {self._endpoint} is unavailable: {failure}") from None
        try:
            sync = await in_thread(self._make_sync_client)
        except Exception as exc:
            await client.close()
            raise TierUnavailable(
                f"cannot set up the S3 client for {self._endpoint}: {type(exc).__name__}: {exc}"
            ) from None
        self._fs, self._client, self._sync = fs, client, sync
        self._threads = IOThreads(self.config.max_concurrency, f"tierkv-{self.name}")
        self._gate = anyio.Semaphore(self.config.max_concurrency)
        logger.info("s3 tier open: %r", self)

    async def _no_credentials(self, client: Any, failure: str) -> str:
        """What to say when the client found no credentials: whether the endpoint
        answers too (an unreachable one is named first: fixing the credentials alone
        would not do), and where credentials may come from."""
        source = self.config.credential_source
        _, _, why = failure.partition(": ")  # "bucket 'b': NoCredentialsError: ..."
        fix = (
            "give the tier credentials: `access_key_id` and `secret_access_key`, a "
            "`profile`, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment"
        )
        url = str(getattr(getattr(client, "meta", None), "endpoint_url", "") or "")
        timeout = min(self.config.request_timeout, _PROBE_TIMEOUT)
        unreachable = await probe_endpoint(url, timeout) if url else None
        if unreachable is not None:
            return (
                f"S3 at {self._endpoint} is unreachable ({unreachable}) and no credentials "
                f"were found ({source}: {why or failure}): check the network, `endpoint_url` "
                f"and that the S3 service runs there, and {fix}"
            )
        return (
            f"no credentials for S3 bucket {self._names.bucket!r} at {self._endpoint} "
            f"(it answers; {source}: {why or failure}): {fix}"
        )

    async def close(self) -> None:
        await self._inflight.drain()
        fs = self._fs
        if fs is not None:
            with anyio.CancelScope(shield=True):
                await self._multipart.clean_up(fs, self.config.request_timeout)
        client, self._client, self._fs = self._client, None, None
        sync, self._sync = self._sync, None
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.close()
        self._present.clear()
        if client is not None:
            await client.close()
        if sync is not None:
            await in_thread(sync.close)

    def _sync_client(self) -> tuple[Any, IOThreads]:
        if self._sync is None or self._threads is None:
            raise TierUnavailable(f"tier {self.name!r} is not open; call open() first")
        return self._sync, self._threads

    def _require_fs(self) -> tuple[S3FileSystem, anyio.Semaphore]:
        if self._inflight.closing:
            raise TierUnavailable(f"tier {self.name!r} is closed")
        if self._fs is None or self._gate is None:
            raise TierUnavailable(f"tier {self.name!r} is not open; call open() first")
        return self._fs, self._gate

    # -- the existence cache ----------------------------------------------------------
    def _saw(self, key: OffloadKey) -> None:
        if self.config.exists_cache_ttl <= 0:
            return
        self._present[key] = time.monotonic()
        self._present.move_to_end(key)
        while len(self._present) > _PRESENT_MAX:
            self._present.popitem(last=False)

    def _known(self, key: OffloadKey) -> bool:
        seen = self._present.get(key)
        if seen is None:
            return False
        if time.monotonic() - seen >= self.config.exists_cache_ttl:
            del self._present[key]
            return False
        return True

    # -- jobs -----------------------------------------------------------------------
    async def _run_job(
        self,
        job: JobMetadata,
        one: Callable[[S3FileSystem, OffloadKey, int, SlotGuard], Awaitable[None]],
        verb: str,
    ) -> JobResult:
        """Run `one(fs, key, slot, guard)` for every key, at most max_concurrency at a
        time. `one` raises S3Failure to fail its key; a thread it leaves behind touches
        slots only under `guard`, closed before this returns."""
        fs, gate = self._require_fs()
        guard = SlotGuard()

        async def work(batch: Batch) -> dict[OffloadKey, str] | None:
            [(key, slot)] = batch
            try:
                async with gate:
                    await one(fs, key, slot, guard)
            except S3Failure as failure:
                if failure.kind in JOB_WIDE:
                    raise JobAborted(str(failure)) from None
                return {key: str(failure)}
            return None

        def forget(keys: Sequence[OffloadKey]) -> None:
            for key in keys:
                self._present.pop(key, None)

        try:
            return await run_job(
                job,
                work,
                label=f"s3 {verb}",
                concurrency=self.config.max_concurrency,
                timeout=self.config.job_timeout,
                on_late=forget,
            )
        finally:
            guard.close()  # threads left behind touch no slot from now on

    async def store(self, job: JobMetadata) -> JobResult:
        async with self._inflight.job():
            return await self._run_job(job, self._store_one, "store")

    async def _store_one(
        self, fs: S3FileSystem, key: OffloadKey, slot: int, guard: SlotGuard
    ) -> None:
        if self.framer.frame_bytes(key, self.primary.block_bytes) >= 2 * int(self.config.part_size):
            frame = await in_thread(
                self.framer.encode, key, self.primary.payload(slot), limiter=self._cpu
            )
            await self._multipart.put(fs, key, frame, self.config.request_timeout)
        else:
            sync, threads = self._sync_client()
            framed: list[bytes] = []  # the frame, made once, kept for a retry
            await self._call(
                f"store of {self._names.url(key)}",
                lambda: threads.run(self._put_in_thread, sync, key, slot, guard, framed),
            )
        self._saw(key)

    def _put_in_thread(
        self, sync: Any, key: OffloadKey, slot: int, guard: SlotGuard, framed: list[bytes]
    ) -> None:
        """Worker thread: frame the block (reading its slot while the job lives; once
        per store, a retry reuses it) and PUT it."""
        if not framed:
            with guard.hold() as alive:
                if not alive:
                    raise JobEnded("s3 store: the job ended before this block was read")
                framed.append(self.framer.encode(key, self.primary.payload(slot)))
        sync.put_object(Bucket=self._names.bucket, Key=self._names.key(key), Body=framed[0])

    async def load(self, job: JobMetadata) -> JobResult:
        async with self._inflight.job():
            return await self._run_job(job, self._load_one, "load")

    async def _load_one(
        self, fs: S3FileSystem, key: OffloadKey, slot: int, guard: SlotGuard
    ) -> None:
        url = self._names.url(key)
        sync, threads = self._sync_client()
        try:
            corrupt = await self._call(
                f"load of {url}", lambda: threads.run(self._get_in_thread, sync, key, slot, guard)
            )
        except S3Failure as failure:
            self._present.pop(key, None)  # a failed load withdraws the cached claim
            if failure.kind == "missing":
                self.report_removed([key])  # gone behind the tier's back
                raise S3Failure("missing", f"{url} is not in s3") from None
            raise
        if corrupt is not None:
            self._present.pop(key, None)
            if isinstance(corrupt, ForeignBlock):  # another trust domain's: theirs to keep
                self.report_foreign([key])
                raise S3Failure("fatal", f"{url}: {corrupt}") from None
            await self._delete_quietly(fs, key)
            self.report_removed([key])
            raise S3Failure("fatal", f"corrupt block deleted: {url}: {corrupt}") from None
        self._saw(key)

    def _get_in_thread(
        self, sync: Any, key: OffloadKey, slot: int, guard: SlotGuard
    ) -> CorruptBlock | None:
        """Worker thread: GET the object, check its frame and copy the payload into the
        slot while the job lives; the frame's failed check, if any."""
        reply = sync.get_object(Bucket=self._names.bucket, Key=self._names.key(key))
        with reply["Body"] as body:
            frame = body.read()
        with guard.hold() as alive:
            if not alive:
                raise JobEnded("s3 load: the job ended before this block was written")
            try:
                self.framer.decode_into(key, frame, self.primary.payload(slot))
            except CorruptBlock as exc:
                return detached(exc)
        return None

    async def _delete_quietly(self, fs: S3FileSystem, key: OffloadKey) -> None:
        try:
            await self._call(
                f"delete of {self._names.url(key)}",
                lambda: fs._call_s3(
                    "delete_object", Bucket=self._names.bucket, Key=self._names.key(key)
                ),
            )
        except S3Failure as failure:
            logger.warning("s3: could not delete a corrupt block: %s", failure)

    # -- lookup and remove ----------------------------------------------------------
    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        """HEAD each key not known present, concurrently; an object of the wrong size
        counts as absent. Raises TierUnavailable when S3 cannot answer at all; a key
        whose HEAD keeps failing (throttled, timing out) counts as absent."""
        if not keys:
            return []
        async with self._inflight.job():
            fs, gate = self._require_fs()
            answer = [self._known(key) for key in keys]
            todo = iter([i for i, known in enumerate(answer) if not known])
            job_wide: list[S3Failure] = []
            block_bytes = self.primary.block_bytes

            async def head(key: OffloadKey) -> Any:
                return await fs._call_s3(
                    "head_object", Bucket=self._names.bucket, Key=self._names.key(key)
                )

            async def worker() -> None:
                for i in todo:
                    if job_wide:
                        return
                    key = keys[i]
                    try:
                        async with gate:
                            info = await self._call(
                                f"lookup of {self._names.url(key)}", partial(head, key)
                            )
                    except S3Failure as failure:
                        if failure.kind in JOB_WIDE:
                            job_wide.append(failure)
                        elif failure.kind != "missing":
                            logger.warning("s3 lookup: counted as absent: %s", failure)
                        continue
                    size = int(info.get("ContentLength", -1))
                    if size == self.framer.frame_bytes(key, block_bytes):
                        answer[i] = True
                        self._saw(key)

            with anyio.move_on_after(self.config.job_timeout) as scope:
                async with anyio.create_task_group() as tg:
                    for _ in range(min(self.config.max_concurrency, len(keys))):
                        tg.start_soon(worker)
            if job_wide:
                raise TierUnavailable(f"s3 lookup failed: {job_wide[0]}")
            if scope.cancelled_caught:
                raise TierUnavailable(
                    f"s3 lookup did not finish within job_timeout={self.config.job_timeout}s"
                )
            return answer

    async def remove(self, keys: Sequence[OffloadKey]) -> None:
        """Delete the objects (batched DeleteObjects); raises TierUnavailable when S3
        does not confirm."""
        if not keys:
            return
        async with self._inflight.job():
            fs, gate = self._require_fs()
            for key in keys:
                self._present.pop(key, None)
            bucket = self._names.bucket

            async def delete(objects: list[dict[str, str]]) -> Any:
                return await fs._call_s3(
                    "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True}
                )

            for lo in range(0, len(keys), _DELETE_BATCH):
                objects = [{"Key": self._names.key(k)} for k in keys[lo : lo + _DELETE_BATCH]]
                try:
                    async with gate:
                        reply = await self._call(
                            f"delete of {len(objects)} objects in s3://{bucket}",
                            partial(delete, objects),
                        )
                except S3Failure as failure:
                    raise TierUnavailable(f"s3 remove failed: {failure}") from None
                errors = reply.get("Errors") or []
                if errors:
                    first = errors[0]
                    raise TierUnavailable(
                        f"s3 refused to delete {len(errors)} objects in s3://{bucket}, e.g. "
                        f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                    )

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "type": "s3",
            "objects": f"s3://{self._names.bucket}/{self._names.root}/",
            "endpoint": self._endpoint,
            "region": c.region,
            "credentials": c.credential_source,
            "max_concurrency": c.max_concurrency,
            "part_size": int(c.part_size),
            "retries": c.retries,
            "exists_cache_ttl": c.exists_cache_ttl,
            "mac": self.framer.mac,
            "open": self._fs is not None,
        }
