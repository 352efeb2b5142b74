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

Blocks in the two-level layout of earlier tiers (`ab/cd/<name>.blk`, see `layout.py`)
are checked the same way and moved up to `ab/<name>.blk` with one `rename` each (where
that name already holds the block, the old copy is deleted instead); emptied
second-level directories are removed. A crash halfway leaves some moved and some not,
and the next `open` moves the rest.

Each fan-out directory is scanned in one worker-thread call, so a disk with many
blocks is scanned with `io_concurrency` threads and ~256 thread round trips.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.contract.framing import Framer
from tierkv.tier import CorruptBlock, OffloadKey
from tierkv_nvme.blockfile import read_header
from tierkv_nvme.layout import (
    BLOCK_SUFFIX,
    TEMP_SUFFIX,
    block_relpath,
    is_fanout_name,
    legacy_relpath,
)

logger = logging.getLogger(__name__)


_pause_lock = threading.Lock()
_pause_holders = 0
_pause_was_enabled = False


@contextlib.contextmanager
def cycles_uncollected() -> Iterator[None]:
    """Python's cycle collector paused while an open rebuilds its index: a collection
    walks every tracked object built so far, and a rebuild builds one or more per
    block (a 262,144-block slab open on the dev VM spent half its time collecting:
    1.24-1.47 s with it, 0.63-0.70 without). Process-wide and counted (stripes open
    side by side, their scans in worker threads): the collector runs again when the
    last holder leaves, if it ran when the first came. Nothing is lost meanwhile, only
    postponed: cycles made elsewhere in the process wait for that collection."""
    global _pause_holders, _pause_was_enabled
    with _pause_lock:
        if _pause_holders == 0:
            _pause_was_enabled = gc.isenabled()
            gc.disable()
        _pause_holders += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pause_holders -= 1
            if _pause_holders == 0 and _pause_was_enabled:
                gc.enable()


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
    moved_up: int = 0
    """Blocks found in the two-level layout and moved to the one-level path."""
    converted: int = 0
    """Block files moved into a slab's slots (`convert.files_into_slots`)."""

    def merge(self, other: ScanResult) -> None:
        self.blocks.extend(other.blocks)
        self.removed_temp.extend(other.removed_temp)
        self.removed_bad.extend(other.removed_bad)
        self.ignored.extend(other.ignored)
        self.moved_up += other.moved_up
        self.converted += other.converted


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
    path: Path,
    rel: tuple[str, ...],
    framer: Framer,
    block_bytes: int,
    relpath: Callable[[OffloadKey], tuple[str, ...]] = block_relpath,
) -> tuple[FoundBlock | None, str]:
    """(the block, "") when `path` (at `rel` in the namespace directory, where the
    layout's `relpath` must put its key) is a good block file, else (None, reason)."""
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
    if relpath(header.key) != rel:
        return None, "header names a key that does not belong at this path"
    return FoundBlock(header.key, expected, stat.st_mtime_ns), ""


def _list(directory: str | Path, result: ScanResult) -> list[os.DirEntry[str]] | None:
    """The entries of `directory`, or None (logged, counted as ignored) when it cannot
    be listed: one unreadable directory must not cost the rest."""
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except FileNotFoundError:
        return []
    except OSError as exc:
        logger.warning("nvme tier: cannot list %s: %s; its blocks are skipped", directory, exc)
        result.ignored.append(Path(directory))
        return None


def _block_file(entry: os.DirEntry[str], result: ScanResult) -> Path | None:
    """The path of `entry` if it is a block file; otherwise None, after deleting it if
    it is a temporary file and noting it as ignored if it is anything else."""
    path = Path(entry.path)
    if entry.is_file(follow_symlinks=False):
        if entry.name.endswith(BLOCK_SUFFIX):
            return path
        if entry.name.endswith(TEMP_SUFFIX):
            if _remove(path):
                result.removed_temp.append(path)
            return None
    result.ignored.append(path)
    return None


def scan_fanout_dir(top: Path, framer: Framer, block_bytes: int) -> ScanResult:
    """Scan one fan-out directory (`ns/ab/`): its block files, and the second-level
    directories (`ns/ab/cd/`) of the two-level layout, whose blocks move up to `ns/ab/`.

    Blocking; run in a worker thread."""
    result = ScanResult()
    first = top.name
    entries = _list(top, result)
    if entries is None:
        return result
    legacy: list[os.DirEntry[str]] = []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and is_fanout_name(entry.name):
            legacy.append(entry)
            continue
        path = _block_file(entry, result)
        if path is None:
            continue
        block, reason = _check_block(path, (first, entry.name), framer, block_bytes)
        if block is not None:
            result.blocks.append(block)
        elif _remove(path):
            result.removed_bad.append((path, reason))
    for leaf in legacy:
        _move_up(top, leaf, framer, block_bytes, result)
    return result


def _move_up(
    top: Path,
    leaf: os.DirEntry[str],
    framer: Framer,
    block_bytes: int,
    result: ScanResult,
) -> None:
    """Check the blocks of the two-level directory `leaf` under `top` (whose own block
    files are already scanned) and move each up into `top`; remove `leaf` if that
    leaves it empty."""
    entries = _list(leaf.path, result)
    if entries is None:
        return
    for entry in entries:
        path = _block_file(entry, result)
        if path is None:
            continue
        rel = (top.name, leaf.name, entry.name)
        block, reason = _check_block(path, rel, framer, block_bytes, legacy_relpath)
        if block is not None and os.path.lexists(top / entry.name):
            block, reason = None, "the same block is also stored one level up"
        if block is None:
            if _remove(path):
                result.removed_bad.append((path, reason))
            continue
        try:
            os.rename(path, top / entry.name)
        except OSError as exc:
            logger.warning("nvme tier: could not move %s up to %s: %s", path, top, exc)
            result.ignored.append(path)
            continue
        result.blocks.append(block)
        result.moved_up += 1
    with contextlib.suppress(OSError):  # not empty: what the tier did not write stays
        os.rmdir(leaf.path)


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
