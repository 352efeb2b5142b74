"""How blocks are named in Mooncake Store.

    <key_prefix><namespace tag>/<key hex>

The namespace tag is 128 bits of sha256 of the namespace, so two namespaces never name
the same object (and the frame header checks the namespace again on the way back).
"""

from __future__ import annotations

import hashlib

from tierkv.tier import OffloadKey


def namespace_tag(namespace: str) -> str:
    """32 hex digits that stand for `namespace` in stored names."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:32]


class BlockNames:
    def __init__(self, key_prefix: str, namespace: str) -> None:
        self.prefix = f"{key_prefix}{namespace_tag(namespace)}/"

    def name(self, key: OffloadKey) -> str:
        return f"{self.prefix}{key.hex()}"
