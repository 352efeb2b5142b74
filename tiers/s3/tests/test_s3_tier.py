"""The s3 tier against a real S3 API (moto's server over HTTP on loopback): the shared
conformance suite, then what a shared object store tier has to get right: untrusted
objects, namespaces, real deletion, a stale existence cache, throttling, 5xx, timeouts
and dropped connections (injected by a proxy on the wire), an endpoint that goes away
and comes back, a missing bucket, multipart uploads, and secrets that never show."""

from __future__ import annotations

import itertools
import json
import logging
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest
from aiobotocore.session import AioSession  # type: ignore[import-untyped]
from pydantic import ValidationError
from s3fs import S3FileSystem  # type: ignore[import-untyped]
from tierkv_s3 import S3Tier, S3TierConfig
from tierkv_s3 import tier as s3_tier_module
from tierkv_s3.testing import Fault, FaultProxy, MotoServer

from tierkv.contract.errors import ConfigError, TierUnavailable
from tierkv.contract.framing import encode_block
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.primary import PrimaryTier, PrimaryView
from tierkv.registry import get_tier_class, installed_tiers
from tierkv.testing import TierConformanceSuite, fill_slots, random_keys
from tierkv.tier import SecondaryTierManager

pytestmark = pytest.mark.anyio

BUCKET = "tierkv-tests"
SECRET = "tierkv-secret-DO-NOT-LOG-7f3a"
CTX = ReqContext(request_id="s3-tests")
_job_ids = itertools.count(1)


def job(keys: list[OffloadKey], slots: list[int] | range) -> JobMetadata:
    return JobMetadata(next(_job_ids), tuple(keys), tuple(slots), CTX)


def make_primary(namespace: str = "s3-tests", slots: int = 32, block: int = 4096) -> PrimaryTier:
    return PrimaryTier(slots, block, pin_memory=False, namespace=namespace)


def s3_tier(endpoint: str, view: PrimaryView, **fields: Any) -> S3Tier:
    """A tier under a fresh prefix of the test bucket (or `prefix=`), fast retries."""
    prefix = fields.pop("prefix", None) or uuid.uuid4().hex
    settings_ = {
        "url": f"s3://{BUCKET}/{prefix}",
        "endpoint_url": endpoint,
        "access_key_id": "testing",
        "secret_access_key": SECRET,
        "retry_backoff": "20ms",
        "request_timeout": "5s",
        **fields,
    }
    return S3Tier(S3TierConfig.model_validate(settings_), view)


@asynccontextmanager
async def opened(tier: S3Tier) -> AsyncIterator[S3Tier]:
    await tier.open()
    try:
        yield tier
    finally:
        await tier.close()


_RAW_SESSION = AioSession()  # parsing the S3 model once, not per client


@asynccontextmanager
async def raw_s3(endpoint: str) -> AsyncIterator[S3FileSystem]:
    """An independent s3fs client: what is really in the bucket, behind the tier's back."""
    fs = S3FileSystem(
        session=_RAW_SESSION,
        asynchronous=True,
        skip_instance_cache=True,
        use_listings_cache=False,
        endpoint_url=endpoint,
        key="testing",
        secret="testing",
    )
    client = await fs.set_session()
    try:
        yield fs
    finally:
        await client.close()


# -- the conformance suite ----------------------------------------------------------
class _S3Conformance(TierConformanceSuite):
    supports_capacity = False  # a bucket has no size bound the tier enforces
    tier_settings: ClassVar[dict[str, object]] = {}
    endpoint = ""

    def make_tier(
        self, primary: PrimaryView, *, capacity_blocks: int | None, **fields: Any
    ) -> SecondaryTierManager:
        return s3_tier(self.endpoint, primary, **{**self.tier_settings, **fields})

    async def corrupt(self, tier: SecondaryTierManager, key: OffloadKey) -> None:
        assert isinstance(tier, S3Tier)
        async with raw_s3(self.endpoint) as fs:
            path = tier._names.path(key)
            frame = await fs._cat_file(path)
            await fs._pipe_file(path, frame[:-1] + bytes([frame[-1] ^ 0xFF]))

    async def plant(self, tier: SecondaryTierManager, key: OffloadKey, frame: bytes) -> None:
        assert isinstance(tier, S3Tier)
        async with raw_s3(self.endpoint) as fs:
            await fs._pipe_file(tier._names.path(key), frame)


class TestS3Conformance(_S3Conformance):
    """Straight to moto, defaults (existence cache on)."""

    @pytest.fixture(autouse=True)
    def _endpoint(self, moto_server: MotoServer) -> None:
        self.endpoint = moto_server.endpoint_url


class TestS3ThroughProxyConformance(_S3Conformance):
    """Through the fault proxy (no faults), no existence cache, two requests at a time."""

    tier_settings: ClassVar[dict[str, object]] = {"exists_cache_ttl": 0, "max_concurrency": 2}

    @pytest.fixture(autouse=True)
    def _endpoint(self, proxy: FaultProxy) -> None:
        self.endpoint = proxy.url


# -- configuration, registration, secrets -------------------------------------------
def test_entry_point_resolves_to_the_s3_tier() -> None:
    assert get_tier_class("s3") is S3Tier
    info = installed_tiers()["s3"]
    assert info.target == "tierkv_s3:S3Tier"
    assert info.distribution == "tierkv-cache-s3"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"url": "https://bucket/prefix"}, "is not an S3 URL"),
        ({"url": "s3://Bad_Bucket/p"}, "not a valid bucket name"),
        ({"url": "s3://ab/p"}, "not a valid bucket name"),
        ({"url": "s3://bucket/p?x=1"}, "takes no"),
        ({"part_size": "1MiB"}, "at least 5MiB"),
        ({"access_key_id": "AKIA"}, "together"),
        ({"secret_access_key": "s"}, "together"),
        ({"session_token": "t"}, "session_token needs"),
        ({"profile": "p", "access_key_id": "a", "secret_access_key": "s"}, "not both"),
        ({"endpoint_url": "127.0.0.1:9000"}, "not an http"),
        ({"request_timeout": 0}, "greater than 0"),
        ({"max_concurency": 4}, "Extra inputs are not permitted"),
    ],
)
def test_bad_config_is_refused_with_a_clear_message(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        S3TierConfig.model_validate({"url": "s3://bucket/prefix", **fields})


def test_yaml_config_reads_secrets_from_the_environment_and_names_bad_paths() -> None:
    from tierkv.config import parse_config

    base = {
        "namespace": "n",
        "layout": {"block_bytes": 4096, "groups": [{"block_size": 16}]},
        "primary": {"capacity": "1MiB"},
    }
    tier = {
        "type": "s3",
        "url": "s3://kv-bucket/llama",
        "access_key_id": "${S3_KEY}",
        "secret_access_key": "${S3_SECRET}",
        "part_size": "16MiB",
        "request_timeout": "2s",
    }
    config = parse_config({**base, "tiers": [tier]}, env={"S3_KEY": "AK", "S3_SECRET": SECRET})
    tier_config = config.tiers[0]
    assert isinstance(tier_config, S3TierConfig)
    assert tier_config.secret_access_key is not None
    assert tier_config.secret_access_key.get_secret_value() == SECRET
    assert (tier_config.bucket, tier_config.prefix) == ("kv-bucket", "llama")
    assert SECRET not in repr(config)
    with pytest.raises(ConfigError) as err:
        parse_config({**base, "tiers": [{"type": "s3", "url": "s3://x", "retries": -1}]})
    assert "tiers[0].url" in str(err.value) and "tiers[0].retries" in str(err.value)


async def test_secrets_never_appear_in_reprs_descriptions_errors_or_logs(
    proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    token = "session-token-DO-NOT-LOG-91c2"
    view = make_primary().view
    caplog.set_level(logging.DEBUG)  # every logger, botocore's and s3fs's included
    tier = s3_tier(proxy.url, view, session_token=token, retries=1)
    shown = [repr(tier.config), str(tier.config), repr(tier), json.dumps(tier.describe())]
    rng = random.Random(1)
    async with opened(tier):
        keys = random_keys(2, rng)
        fill_slots(view, range(2), rng)
        assert (await tier.store(job(keys, range(2)))).ok
        proxy.inject(Fault(match=keys[0].hex(), status=403, code="AccessDenied", message="no"))
        result = await tier.load(job(keys, range(2, 4)))
        assert result.failed_keys == (keys[0],)
        shown.append(result.error or "")
    missing = s3_tier(proxy.url, view, url="s3://tierkv-nonexistent/p")
    with pytest.raises(TierUnavailable) as err:
        await missing.open()
    shown.append(str(err.value))
    for text in shown:
        assert SECRET not in text and token not in text
    assert SECRET not in caplog.text, "the secret key must never be logged"
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("tierkv"))
    assert token not in ours


async def test_credentials_come_from_the_standard_chain_when_not_configured(
    moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-the-environment")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    view = make_primary().view
    config = S3TierConfig(
        url=f"s3://{BUCKET}/{uuid.uuid4().hex}", endpoint_url=moto_server.endpoint_url
    )
    tier = S3Tier(config, view)
    assert tier.describe()["credentials"] == "default AWS chain"
    rng = random.Random(14)
    async with opened(tier):
        keys = random_keys(2, rng)
        data = fill_slots(view, range(2), rng)
        assert (await tier.store(job(keys, range(2)))).ok
        assert (await tier.load(job(keys, [2, 3]))).ok
        assert [bytes(view.block(2)), bytes(view.block(3))] == [data[0], data[1]]


@pytest.fixture
def no_aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials anywhere in the AWS chain, and fresh botocore sessions (a shared
    one keeps the credentials an earlier test's environment gave it)."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(s3_tier_module, "_SESSIONS", {})
    monkeypatch.setattr(s3_tier_module, "_SYNC_SESSIONS", {})


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.usefixtures("no_aws_credentials")
async def test_no_credentials_and_an_unreachable_endpoint_are_both_named() -> None:
    """Botocore raises NoCredentialsError before it sends anything: the tier probes the
    endpoint, so a user is not sent after credentials while nothing listens there."""
    url = f"http://127.0.0.1:{_closed_port()}"
    config = S3TierConfig(url=f"s3://{BUCKET}/p", endpoint_url=url, retries=0)
    started = time.monotonic()
    with pytest.raises(TierUnavailable) as err:
        await S3Tier(config, make_primary().view).open()
    assert time.monotonic() - started < 5
    message = str(err.value)
    assert f"S3 at {url} is unreachable" in message
    assert "Connection refused" in message
    assert "no credentials were found (default AWS chain: NoCredentialsError" in message
    assert "AWS_ACCESS_KEY_ID" in message and "`endpoint_url`" in message


@pytest.mark.usefixtures("no_aws_credentials")
async def test_no_credentials_at_an_endpoint_that_answers_says_so(
    moto_server: MotoServer,
) -> None:
    endpoint = moto_server.endpoint_url
    config = S3TierConfig(url=f"s3://{BUCKET}/p", endpoint_url=endpoint, retries=0)
    with pytest.raises(TierUnavailable) as err:
        await S3Tier(config, make_primary().view).open()
    message = str(err.value)
    assert message.startswith(f"no credentials for S3 bucket {BUCKET!r} at {endpoint} (it answers")
    assert "unreachable" not in message
    assert "`access_key_id` and `secret_access_key`, a `profile`" in message


# -- untrusted objects, namespaces, deletion, the existence cache -------------------
async def test_forged_or_damaged_objects_fail_their_keys_and_are_deleted(
    moto_server: MotoServer,
) -> None:
    rng = random.Random(2)
    view = make_primary().view
    endpoint = moto_server.endpoint_url
    async with opened(s3_tier(endpoint, view)) as tier, raw_s3(endpoint) as fs:
        keys = random_keys(6, rng)
        data = fill_slots(view, range(6), rng)
        assert (await tier.store(job(keys, range(6)))).ok
        path = tier._names.path
        await fs._pipe_file(path(keys[0]), await fs._cat_file(path(keys[1])))  # another key's
        await fs._pipe_file(path(keys[2]), b"\x80\x04\x95" + b"a pickle, never unpickled" * 200)
        await fs._pipe_file(path(keys[3]), encode_block(keys[3], data[3], "another-namespace"))
        await fs._pipe_file(path(keys[4]), (await fs._cat_file(path(keys[4])))[:-10])
        sentinel = b"\xee" * view.block_bytes
        for slot in range(10, 16):
            view.block(slot)[:] = sentinel
        result = await tier.load(job(keys, range(10, 16)))
        forged = [keys[0], keys[2], keys[3], keys[4]]
        assert set(result.failed_keys) == set(forged)
        assert result.error and "corrupt block deleted" in result.error
        for reason in ("expected", "bad magic", "another namespace", "payload is"):
            assert reason in result.error
        for slot in (10, 12, 13, 14):  # a slot is written only after every check passed
            assert bytes(view.block(slot)) == sentinel
        assert [bytes(view.block(11)), bytes(view.block(15))] == [data[1], data[5]]
        for key in forged:
            assert not await fs._exists(path(key)), "a corrupt object must be deleted"
        assert await tier.lookup(keys, CTX) == [False, True, False, False, False, True]


async def test_an_object_of_the_wrong_size_is_absent_to_lookups(moto_server: MotoServer) -> None:
    rng = random.Random(3)
    view = make_primary().view
    endpoint = moto_server.endpoint_url
    async with opened(s3_tier(endpoint, view, exists_cache_ttl=0)) as tier, raw_s3(endpoint) as fs:
        [key] = random_keys(1, rng)
        await fs._pipe_file(tier._names.path(key), b"TKVB short")
        assert await tier.lookup([key], CTX) == [False]


async def test_namespaces_never_see_each_other(moto_server: MotoServer) -> None:
    rng = random.Random(4)
    a, b = make_primary("model-a"), make_primary("model-b")
    endpoint = moto_server.endpoint_url
    async with (
        opened(s3_tier(endpoint, a.view, prefix="shared")) as tier_a,
        opened(s3_tier(endpoint, b.view, prefix="shared")) as tier_b,
    ):
        keys = random_keys(4, rng)
        data = fill_slots(a.view, range(4), rng)
        assert (await tier_a.store(job(keys, range(4)))).ok
        assert await tier_b.lookup(keys, CTX) == [False] * 4
        assert set((await tier_b.load(job(keys, range(4)))).failed_keys) == set(keys)
        await tier_b.remove(keys)  # deletes nothing of model-a's
        assert (await tier_a.load(job(keys, range(4, 8)))).ok
        assert [bytes(a.view.block(s)) for s in range(4, 8)] == [data[s] for s in range(4)]


async def test_remove_really_deletes_the_objects(moto_server: MotoServer) -> None:
    rng = random.Random(5)
    view = make_primary().view
    endpoint = moto_server.endpoint_url
    async with opened(s3_tier(endpoint, view)) as tier, raw_s3(endpoint) as fs:
        keys = random_keys(5, rng)
        fill_slots(view, range(5), rng)
        assert (await tier.store(job(keys, range(5)))).ok
        root = f"{BUCKET}/{tier._names.root}"
        assert len(await fs._find(root)) == 5
        await tier.remove([keys[0], keys[3], *random_keys(2, rng)])
        left = sorted(p.rsplit("/", 1)[1] for p in await fs._find(root))
        assert left == sorted(k.hex() for k in (keys[1], keys[2], keys[4]))


async def test_a_failed_load_withdraws_a_stale_existence_claim(moto_server: MotoServer) -> None:
    rng = random.Random(6)
    view = make_primary().view
    endpoint = moto_server.endpoint_url
    cached = s3_tier(endpoint, view, exists_cache_ttl="1h")
    async with opened(cached) as tier, raw_s3(endpoint) as fs:
        keys = random_keys(2, rng)
        fill_slots(view, range(2), rng)
        assert (await tier.store(job(keys, range(2)))).ok
        await fs._rm_file(tier._names.path(keys[0]))  # another server evicted it
        assert await tier.lookup(keys, CTX) == [True, True], "trusted within the ttl"
        result = await tier.load(job(keys, [2, 3]))
        assert result.failed_keys == (keys[0],) and "is not in s3" in (result.error or "")
        assert await tier.lookup(keys, CTX) == [False, True], "and never again after a miss"
    async with opened(s3_tier(endpoint, view, exists_cache_ttl=0)) as tier, raw_s3(endpoint) as fs:
        [key] = random_keys(1, rng)
        assert (await tier.store(job([key], [0]))).ok
        await fs._rm_file(tier._names.path(key))
        assert await tier.lookup([key], CTX) == [False], "ttl 0 asks S3 every time"


# -- faults on the wire ---------------------------------------------------------------
async def test_throttling_is_retried_with_backoff_and_then_succeeds(proxy: FaultProxy) -> None:
    rng = random.Random(7)
    view = make_primary().view
    async with opened(s3_tier(proxy.url, view, retry_backoff="50ms")) as tier:
        keys = random_keys(3, rng)
        data = fill_slots(view, range(3), rng)
        assert (await tier.store(job(keys, range(3)))).ok
        proxy.inject(Fault(match=keys[0].hex(), methods=frozenset({"GET"}), times=2))
        started = time.monotonic()
        result = await tier.load(job(keys, range(3, 6)))
        assert result.ok, result.error
        assert time.monotonic() - started >= 0.025 + 0.05, "backoff waits between tries"
        assert proxy.count(keys[0].hex(), "GET") == 3
        assert [bytes(view.block(s)) for s in range(3, 6)] == [data[s] for s in range(3)]


async def test_persistent_errors_fail_only_their_keys_with_a_clear_error(
    proxy: FaultProxy,
) -> None:
    rng = random.Random(8)
    view = make_primary().view
    async with opened(s3_tier(proxy.url, view, retries=2)) as tier:
        keys = random_keys(4, rng)
        data = fill_slots(view, range(4), rng)
        assert (await tier.store(job([keys[0]], [0]))).ok
        proxy.inject(Fault(match=keys[0].hex(), methods=frozenset({"GET"})))
        proxy.inject(
            Fault(match=keys[1].hex(), methods=frozenset({"PUT"}), status=500,
                  code="InternalError", message="We encountered an internal error.")
        )  # fmt: skip
        stored = await tier.store(job(keys[1:], range(1, 4)))
        assert stored.failed_keys == (keys[1],)
        assert "HTTP 500 InternalError" in (stored.error or "")
        assert "gave up after 3 attempts" in (stored.error or "")
        assert keys[1].hex() in (stored.error or ""), "the error names the object"
        assert proxy.count(keys[1].hex(), "PUT") == 3
        loaded = await tier.load(job([keys[0], keys[2], keys[3]], range(4, 7)))
        assert loaded.failed_keys == (keys[0],)
        assert "HTTP 503 SlowDown" in (loaded.error or "")
        assert [bytes(view.block(s)) for s in (5, 6)] == [data[2], data[3]]
        proxy.clear()  # the tier itself needs no reset
        assert (await tier.store(job([keys[1]], [1]))).ok
        assert (await tier.load(job([keys[0], keys[1]], [7, 8]))).ok
        assert [bytes(view.block(s)) for s in (7, 8)] == [data[0], data[1]]


async def test_a_request_that_times_out_is_retried_then_fails_its_key(proxy: FaultProxy) -> None:
    rng = random.Random(9)
    view = make_primary().view
    # 800 ms, not less: the open's bucket check gets the same timeout, and a loaded
    # 2-core machine (moto, the proxy and the test on it) missed 300 ms twice
    tier = s3_tier(proxy.url, view, request_timeout="800ms", retries=1)
    async with opened(tier):
        keys = random_keys(2, rng)
        fill_slots(view, range(2), rng)
        assert (await tier.store(job(keys, range(2)))).ok
        slow = Fault(match=keys[0].hex(), action="delay", delay=8, methods=frozenset({"GET"}))
        proxy.inject(slow)
        started = time.monotonic()
        result = await tier.load(job(keys, [2, 3]))
        assert time.monotonic() - started < 4.0  # two attempts of 0.8 s, not the 8 s delay
        assert result.failed_keys == (keys[0],)
        assert "timed out (gave up after 2 attempts)" in (result.error or "")


async def test_a_dropped_connection_is_retried(proxy: FaultProxy) -> None:
    rng = random.Random(10)
    view = make_primary().view
    async with opened(s3_tier(proxy.url, view)) as tier:
        keys = random_keys(2, rng)
        data = fill_slots(view, range(2), rng)
        proxy.inject(Fault(match=keys[1].hex(), action="drop", methods=frozenset({"PUT"}), times=1))
        assert (await tier.store(job(keys, range(2)))).ok
        assert proxy.count(keys[1].hex(), "PUT") == 2
        assert (await tier.load(job(keys, [2, 3]))).ok
        assert [bytes(view.block(2)), bytes(view.block(3))] == [data[0], data[1]]


async def test_an_endpoint_that_goes_away_fails_jobs_fast_and_the_tier_recovers(
    proxy: FaultProxy,
) -> None:
    rng = random.Random(11)
    view = make_primary().view
    tier = s3_tier(proxy.url, view, retries=2, max_concurrency=4, exists_cache_ttl=0)
    async with opened(tier):
        before = random_keys(4, rng)
        fill_slots(view, range(4), rng)
        assert (await tier.store(job(before, range(4)))).ok
        proxy.stop()  # listener closed, live keep-alive connections cut

        started = time.monotonic()
        result = await tier.store(job(random_keys(20, rng), range(20)))
        assert time.monotonic() - started < 3
        assert len(result.failed_keys) == 20
        assert "Could not connect" in (result.error or "")
        assert "not tried" in (result.error or ""), "keys after the first failures are not tried"
        with pytest.raises(TierUnavailable, match="Could not connect"):
            await tier.lookup(before, CTX)
        with pytest.raises(TierUnavailable, match="Could not connect"):
            await tier.remove(before)

        proxy.start()
        assert await tier.lookup(before, CTX) == [True] * 4, "no reopen needed"
        assert (await tier.load(job(before, range(4, 8)))).ok


async def test_a_missing_bucket_is_named_in_the_error(moto_server: MotoServer) -> None:
    view = make_primary().view
    endpoint = moto_server.endpoint_url
    with pytest.raises(TierUnavailable, match="'tierkv-no-such-bucket' does not exist"):
        await s3_tier(endpoint, view, url="s3://tierkv-no-such-bucket/p").open()

    moto_server.create_bucket("tierkv-doomed")
    tier = s3_tier(endpoint, view, url="s3://tierkv-doomed/p")
    async with opened(tier):
        moto_server.delete_bucket("tierkv-doomed")  # deleted under a running tier
        rng = random.Random(12)
        keys = random_keys(3, rng)
        fill_slots(view, range(3), rng)
        result = await tier.store(job(keys, range(3)))
        assert len(result.failed_keys) == 3
        assert "NoSuchBucket" in (result.error or "") and "tierkv-doomed" in (result.error or "")


async def test_a_large_block_goes_up_in_parts_and_comes_back_whole(proxy: FaultProxy) -> None:
    block = 11 << 20  # a frame >= 2 x part_size is a multipart upload
    primary = PrimaryTier(2, block, pin_memory=False, namespace="big")
    rng = random.Random(13)
    async with opened(s3_tier(proxy.url, primary.view, part_size="5MiB")) as tier:
        [key] = random_keys(1, rng)
        [data] = fill_slots(primary.view, [0], rng).values()
        assert (await tier.store(job([key], [0]))).ok
        parts = [p for m, p in proxy.requests if m == "PUT" and "partNumber=" in p]
        assert len(parts) == 3
        assert (await tier.load(job([key], [1]))).ok
        assert bytes(primary.view.block(1)) == data


# -- life cycle ----------------------------------------------------------------------
async def test_open_is_idempotent_and_close_refuses_later_work(moto_server: MotoServer) -> None:
    view = make_primary().view
    tier = s3_tier(moto_server.endpoint_url, view)
    with pytest.raises(TierUnavailable, match="not open"):
        await tier.lookup(random_keys(1), CTX)
    await tier.open()
    await tier.open()
    assert tier.describe()["open"] is True
    await tier.close()
    with pytest.raises(TierUnavailable, match="closed"):
        await tier.store(job(random_keys(1), [0]))
    async with opened(tier):  # a closed tier may be opened again
        assert await tier.lookup(random_keys(2), CTX) == [False, False]


async def _open_uploads(endpoint: str, prefix: str) -> list[dict[str, Any]]:
    async with raw_s3(endpoint) as fs:
        reply = await fs._call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=prefix)
    return list(reply.get("Uploads") or [])


@pytest.mark.parametrize("how", ["request_timeout", "job_timeout"])
async def test_an_interrupted_multipart_upload_is_aborted(proxy: FaultProxy, how: str) -> None:
    """A part upload cut off by a timeout (a cancellation inside s3fs) must not leave
    an incomplete multipart upload behind: S3 bills its parts until it is aborted."""
    block = 11 << 20
    primary = PrimaryTier(1, block, pin_memory=False, namespace="big")
    prefix = uuid.uuid4().hex
    timeouts = (
        {"request_timeout": "500ms", "retries": 1}
        if how == "request_timeout"
        else {"job_timeout": "500ms", "request_timeout": "10s"}
    )
    tier = s3_tier(proxy.url, primary.view, part_size="5MiB", prefix=prefix, **timeouts)
    async with opened(tier):
        [key] = random_keys(1, random.Random(14))
        fill_slots(primary.view, [0], random.Random(15))
        proxy.inject(
            Fault(match="partNumber=", action="delay", delay=2, methods=frozenset({"PUT"}))
        )
        result = await tier.store(job([key], [0]))
        assert result.failed_keys == (key,)
        proxy.clear()
    assert await _open_uploads(proxy.url, prefix) == []


@pytest.mark.parametrize("retries", [0, 1])
async def test_an_upload_whose_create_timed_out_is_found_and_aborted(
    proxy: FaultProxy, retries: int
) -> None:
    """CreateMultipartUpload times out on the client but reaches S3 later: the upload
    S3 then creates is found (ListMultipartUploads) and aborted, whether the store
    failed (no retries) or a retry succeeded; none is left after close()."""
    block = 10 << 20  # with part_size 5MiB: a multipart upload
    view = PrimaryView(bytearray(block), block, "big")
    prefix = uuid.uuid4().hex
    settings_ = {"part_size": "5MiB", "request_timeout": "1s", "retries": retries}
    tier = s3_tier(proxy.url, view, prefix=prefix, **settings_)
    async with opened(tier):
        [key] = random_keys(1, random.Random(16))
        fill_slots(view, [0], random.Random(17))
        late = proxy.inject(  # the endpoint sits on the create for 1.3 s, then passes it on
            Fault(match="?uploads", action="delay", delay=1.3, methods=frozenset({"POST"}), times=1)
        )
        result = await tier.store(job([key], [0]))
        assert result.ok == (retries > 0), result.error
        for _ in range(200):  # until S3 has the late create (bounded, ~10 s at most)
            if late.forwarded:
                break
            await anyio.sleep(0.05)
        assert late.forwarded == 1
    assert await _open_uploads(proxy.url, prefix) == []
    if retries:
        async with opened(s3_tier(proxy.url, view, prefix=prefix)) as reader:
            assert (await reader.load(job([key], [0]))).ok
