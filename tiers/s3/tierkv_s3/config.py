"""The `type: s3` section of the YAML.

    - type: s3
      url: s3://kv-bucket/prefix
      endpoint_url: http://127.0.0.1:9000     # MinIO, Ceph, moto...; omit for AWS
      region: eu-west-1
      write_policy: write_back

Credentials come from the standard AWS chain (environment, shared config files,
instance role) unless `access_key_id`/`secret_access_key` (and `session_token`) or a
`profile` are given. Secrets are `SecretStr`: no repr, log line or `describe()` shows
them.
"""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    ByteSize,
    Field,
    NonNegativeInt,
    PositiveInt,
    SecretStr,
    field_validator,
    model_validator,
)

from tierkv.contract.units import Duration, Size
from tierkv.tier import TierConfig, redact_url

MIN_PART_SIZE = 5 << 20
"""S3 refuses multipart parts below 5 MiB (but the last)."""

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def split_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix/` -> (`bucket`, `some/prefix`)."""
    parts = urlsplit(url)
    if parts.scheme != "s3":
        raise ValueError(f"{url!r} is not an S3 URL: use s3://bucket/prefix")
    bucket = parts.netloc
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(
            f"{bucket!r} is not a valid bucket name (3-63 of a-z 0-9 . -, "
            "starting and ending with a letter or digit)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: an S3 URL takes no ?query or #fragment")
    return bucket, parts.path.strip("/")


class S3TierConfig(TierConfig):
    """Where the bucket is and how the tier talks to it."""

    type: Literal["s3"] = "s3"
    url: str = Field(description="s3://bucket/prefix; blocks go under prefix/<namespace tag>/")
    endpoint_url: str | None = Field(
        default=None, description="an S3-compatible endpoint, e.g. http://127.0.0.1:9000"
    )
    region: str | None = Field(default=None, description="AWS region of the bucket")
    access_key_id: str | None = Field(default=None, description="omit to use the AWS chain")
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None
    profile: str | None = Field(default=None, description="a profile of ~/.aws/config")
    max_concurrency: PositiveInt = Field(
        default=16, description="S3 requests in flight (and HTTP connections) at once"
    )
    part_size: Size = Field(
        default=ByteSize(8 << 20),
        description="multipart part size; a frame of at least twice this is uploaded "
        "in parts, concurrently",
    )
    retries: NonNegativeInt = Field(
        default=4,
        description="retries of a request that was throttled (429, 503 SlowDown), hit "
        "a 5xx, timed out or lost its connection; then the key fails",
    )
    retry_backoff: Duration = Field(
        default=0.1, description="wait before the first retry; doubles each retry (jittered)"
    )
    retry_backoff_max: Duration = Field(default=5.0, description="longest wait between tries")
    request_timeout: Duration = Field(
        default=15.0, gt=0, description="one attempt of one request, connect to last byte"
    )
    exists_cache_ttl: Duration = Field(
        default=30.0,
        description="how long a lookup trusts that a block this tier saw is still there "
        "(0: ask S3 every time); a failed load forgets it at once",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        split_s3_url(url)
        return url

    @field_validator("endpoint_url")
    @classmethod
    def _check_endpoint(cls, url: str | None) -> str | None:
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{redact_url(url)!r} is not an http(s):// endpoint URL")
        return url

    @field_validator("part_size")
    @classmethod
    def _check_part_size(cls, size: ByteSize) -> ByteSize:
        if size < MIN_PART_SIZE:
            raise ValueError("part_size must be at least 5MiB (the S3 minimum part size)")
        return size

    @model_validator(mode="after")
    def _check_credentials(self) -> S3TierConfig:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("give access_key_id and secret_access_key together, or neither")
        if self.session_token is not None and self.access_key_id is None:
            raise ValueError("session_token needs access_key_id and secret_access_key")
        if self.profile is not None and self.access_key_id is not None:
            raise ValueError("give a profile or explicit keys, not both")
        return self

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            yield name, (redact_url(value) if name == "endpoint_url" and value else value)

    @property
    def bucket(self) -> str:
        return split_s3_url(self.url)[0]

    @property
    def prefix(self) -> str:
        return split_s3_url(self.url)[1]

    @property
    def credential_source(self) -> str:
        """Where credentials come from, for `describe()` (never the credentials)."""
        if self.access_key_id is not None:
            return "config"
        if self.profile is not None:
            return f"profile {self.profile}"
        return "default AWS chain"
