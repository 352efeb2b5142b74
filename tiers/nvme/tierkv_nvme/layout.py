"""Where a block lives on disk, as a pure function of the namespace and the key.

    <path>/ns-<namespace hash, 16 hex>/<hex 0:2>/<key hex>.blk

- One directory per namespace: two models sharing a disk never read, count or evict
  each other's files, and the directory lock (see `tier.py`) is per namespace.
- One level of 256 fan-out directories from the key's leading hex: keys start with a
  block hash, so files spread evenly (~400,000 per directory at 100 million blocks,
  which ext4's and XFS's name indexes handle). One level, not two: a directory costs
  a ~0.5 ms `mkdir` on the dev VM, and with 65,536 leaf directories a new tier made
  one for most of its first ~100,000 blocks, which halved its store speed (measured,
  see the nvme README). Two-level directories written before (`<hex 0:2>/<hex 2:4>/`,
  `legacy_relpath`) are moved up a level by the next `open` (`recovery.py`).
- Names are hex digits only, so no key can name a path outside the tier's directory
  (no `/`, no `..`). A key too long for a file name (over 100 bytes) is named by the
  sha256 of the key instead; the full key is always in the frame header, which is
  what `load` and the index rebuild check.
- Temporary files are `.<final name>.<pid>-<n>.tmp` beside their final name, so the
  rename that publishes a block never crosses a filesystem.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from pathlib import Path

from tierkv.contract.framing import namespace_hash
from tierkv.tier import OffloadKey

BLOCK_SUFFIX = ".blk"
TEMP_SUFFIX = ".tmp"
MAX_HEX_KEY_BYTES = 100
"""Keys up to this long are named by their hex (200 characters + suffix < NAME_MAX)."""

LOCK_NAME = "lock"
NAMESPACE_NOTE = "namespace.txt"

_temp_ids = itertools.count()


def namespace_dir(root: Path, namespace: str) -> Path:
    """The directory holding every block of `namespace` under the tier's `path`."""
    return root / f"ns-{namespace_hash(namespace):016x}"


def _name_hex(key: OffloadKey) -> tuple[str, str]:
    """(file stem, hex the fan-out is taken from) for `key`."""
    if len(key) <= MAX_HEX_KEY_BYTES:
        stem = key.hex()
        return stem, stem
    digest = hashlib.sha256(key).hexdigest()
    return f"sha256-{digest}", digest


def block_relpath(key: OffloadKey) -> tuple[str, str]:
    """(fan-out dir, file name) of `key`."""
    if 0 < len(key) <= MAX_HEX_KEY_BYTES:  # the common case, in short (one per block read)
        stem = key.hex()
        return stem[:2], stem + BLOCK_SUFFIX
    stem, fan = _name_hex(key)
    fan = fan.ljust(2, "0")  # a key shorter than a byte still gets a fan-out directory
    return fan[0:2], stem + BLOCK_SUFFIX


def legacy_relpath(key: OffloadKey) -> tuple[str, str, str]:
    """(first, second fan-out dir, file name) where tiers before the one-level layout
    put `key`; `open` moves such files to `block_relpath`."""
    stem, fan = _name_hex(key)
    fan = fan.ljust(4, "0")
    return fan[0:2], fan[2:4], stem + BLOCK_SUFFIX


def block_path(ns_dir: Path, key: OffloadKey) -> Path:
    """The file that holds `key`'s frame."""
    return ns_dir.joinpath(*block_relpath(key))


def temp_name(final: str) -> str:
    """A fresh temporary file name beside the block file `final` (unique within this
    process and host)."""
    return f".{final}.{os.getpid()}-{next(_temp_ids)}{TEMP_SUFFIX}"


def temp_path(final: Path) -> Path:
    """A fresh temporary path beside `final`."""
    return final.with_name(temp_name(final.name))


def is_fanout_name(name: str) -> bool:
    """Whether `name` is one of the two-hex-digit fan-out directory names."""
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)
