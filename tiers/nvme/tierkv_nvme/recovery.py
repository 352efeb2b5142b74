"""Rebuilding the index from the directory when the tier opens.

The index lives only in memory, so the directory is the truth: every `open` walks the
namespace directory and keeps exactly the files that are whole, well-formed blocks of
this namespace under their right name. It deletes

- temporary files (`*.tmp`): a write that a crash or a kill interrupted;
- block files whose header does not parse (wrong magic, version or flags, another
  namespace, a MAC where the tier has no key or none where it has one),
  whose header names a payload length other than this tier's block size, whose size
  is not header + payload (truncated or padded), or whose header names a key that does
  not belong at that path (a misplaced or renamed file).

Payload checksums are not read here (that would read the whole disk at every start);
a flipped payload bit is caught by the checksum on `load`, which deletes the file.
Anything else found (files not ending in `.blk`/`.tmp`, directories that are not
fan-out directories) is left alone and logged: the tier deletes only what it wrote.

Each top-level fan-out directory is scanned in one worker-thread call, so a disk with
many blocks is scanned with `io_concurrency` threads and ~256 thread round trips.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.framing import Framer
from tierkv.tier import CorruptBlock, OffloadKey
from tierkv_nvme.blockfile import read_header
from tierkv_nvme.layout import BLOCK_SUFFIX, TEMP_SUFFIX, block_relpath, is_fanout_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FoundBlock:
    """A block file that passed every check of the scan."""

    key: OffloadKey
    frame_bytes: int
    mtime_ns: int


@dataclass
class ScanResult:
    """What a scan kept and what it deleted (with the reason, for the log)."""

    blocks: list[FoundBlock] = field(default_factory=list)
    removed_temp: list[Path] = field(default_factory=list)
    removed_bad: list[tuple[Path, str]] = field(default_factory=list)
    ignored: list[Path] = field(default_factory=list)

    def merge(self, other: ScanResult) -> None:
        self.blocks.extend(other.blocks)
        self.removed_temp.extend(other.removed_temp)
        self.removed_bad.extend(other.removed_bad)
        self.ignored.extend(other.ignored)


def _remove(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        logger.warning("could not delete %s: %s", path, exc)
        return False
    return True


def _check_block(
    path: Path, first: str, second: str, framer: Framer, block_bytes: int
) -> tuple[FoundBlock | None, str]:
    """(the block, "") when `path` is a good block file, else (None, reason)."""
    try:
        stat = os.stat(path, follow_symlinks=False)
        header = read_header(path, framer, stat.st_size)
    except CorruptBlock as exc:
        return None, f"bad header: {exc}"
    except OSError as exc:
        return None, f"unreadable: {exc.strerror}"
    if header.payload_length != block_bytes:
        return None, (
            f"payload of {header.payload_length} bytes, this tier's blocks are {block_bytes}"
        )
    expected = header.size + block_bytes
    if stat.st_size != expected:
        return None, f"file is {stat.st_size} bytes, its frame is {expected} (truncated?)"
    if block_relpath(header.key) != (first, second, path.name):
        return None, "header names a key that does not belong at this path"
    return FoundBlock(header.key, expected, stat.st_mtime_ns), ""


def scan_fanout_dir(top: Path, framer: Framer, block_bytes: int) -> ScanResult:
    """Scan one top-level fan-out directory (`ns/ab/`) and its leaf directories.

    Blocking; run in a worker thread."""
    result = ScanResult()
    first = top.name
    try:
        leaves = sorted(os.scandir(top), key=lambda e: e.name)
    except FileNotFoundError:
        return result
    except OSError as exc:
        logger.warning("nvme tier: cannot list %s: %s; its blocks are skipped", top, exc)
        result.ignored.append(top)
        return result
    for leaf in leaves:
        if not (leaf.is_dir(follow_symlinks=False) and is_fanout_name(leaf.name)):
            result.ignored.append(Path(leaf.path))
            continue
        try:
            entries = list(os.scandir(leaf.path))
        except OSError as exc:  # one unreadable directory must not cost the rest
            logger.warning("nvme tier: cannot list %s: %s; its blocks are skipped", leaf.path, exc)
            result.ignored.append(Path(leaf.path))
            continue
        for entry in entries:
            path = Path(entry.path)
            if not entry.is_file(follow_symlinks=False):
                result.ignored.append(path)
            elif entry.name.endswith(TEMP_SUFFIX):
                if _remove(path):
                    result.removed_temp.append(path)
            elif entry.name.endswith(BLOCK_SUFFIX):
                block, reason = _check_block(path, first, leaf.name, framer, block_bytes)
                if block is not None:
                    result.blocks.append(block)
                elif _remove(path):
                    result.removed_bad.append((path, reason))
            else:
                result.ignored.append(path)
    return result


def list_fanout_dirs(ns_dir: Path) -> tuple[list[Path], list[Path]]:
    """(top-level fan-out directories, other entries) of the namespace directory."""
    tops: list[Path] = []
    others: list[Path] = []
    with os.scandir(ns_dir) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and is_fanout_name(entry.name):
                tops.append(Path(entry.path))
            else:
                others.append(Path(entry.path))
    return sorted(tops), others
