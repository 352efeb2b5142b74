"""Secrets never reach a log line through a URL."""

from __future__ import annotations

import pytest

from tierkv.contract.redact import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
        ("rediss://user:s3cret@[::1]:6380/1?x=1", "rediss://user:***@[::1]:6380/1?x=1"),
        ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("redis://:pw@host:notaport/0", "<unparsable url>"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)
