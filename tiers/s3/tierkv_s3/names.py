"""How blocks are named in the bucket.

    <prefix>/<namespace tag>/<key hex>

The namespace tag is 128 bits of sha256 of the namespace, so two namespaces never name
the same object (and the frame header checks the namespace again on the way back).
"""

from __future__ import annotations

import hashlib

from tierkv.contract.keys import OffloadKey


def namespace_tag(namespace: str) -> str:
    """32 hex digits that stand for `namespace` in object names."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:32]


class ObjectNames:
    """Object keys (inside the bucket) and s3fs paths (`bucket/key`) of one tier."""

    def __init__(self, bucket: str, prefix: str, namespace: str) -> None:
        self.bucket = bucket
        self.root = "/".join(part for part in (prefix.strip("/"), namespace_tag(namespace)) if part)

    def key(self, key: OffloadKey) -> str:
        return f"{self.root}/{key.hex()}"

    def path(self, key: OffloadKey) -> str:
        return f"{self.bucket}/{self.key(key)}"

    def url(self, key: OffloadKey) -> str:
        return f"s3://{self.path(key)}"
