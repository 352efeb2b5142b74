"""Block files of the file layout moved into the slots of a slab (`layout: slab`).

A tier that switches to `layout: slab` on a directory that holds block files (the
default layout of earlier versions) keeps its blocks: at `open` each good block file
(checked as the file layout's rebuild checks it, and its payload checksum read) is
written into a free slot and deleted. The newest files go first; those past the free
slots are deleted (evicted), oldest first, as capacity would. A crash midway leaves
some files still there, which the next `open` moves (a block both in a slot and in a
file keeps the newer copy). The reverse, slots back into files, is not done: a tier
that goes back to `layout: files` ignores the slab files (logged) and they can be
deleted by hand.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from tierkv.contract.framing import Framer
from tierkv.tier import CorruptBlock
from tierkv_nvme import slabfile
from tierkv_nvme.layout import block_relpath
from tierkv_nvme.recovery import ScanResult, list_fanout_dirs, scan_fanout_dir

logger = logging.getLogger(__name__)


def files_into_slots(
    ns_dir: Path,
    fds: Sequence[int],
    room: int,
    framer: Framer,
    block_bytes: int,
    free: list[int],
    first_seq: int,
    fsync: bool,
) -> tuple[list[slabfile.FoundSlot], ScanResult]:
    """Worker thread: move the block files under `ns_dir` into the slots `free` (taken
    from its end), sealed from `first_seq` on in the files' mtime order; delete every
    block file. (the slots written, the scan of the files, for its counts)."""
    tops, _others = list_fanout_dirs(ns_dir)
    scan = ScanResult()
    for top in tops:
        scan.merge(scan_fanout_dir(top, framer, block_bytes))
    if not scan.blocks:
        return [], scan
    newest_first = sorted(scan.blocks, key=lambda b: b.mtime_ns, reverse=True)
    moving = newest_first[: len(free)][::-1]  # oldest first: the lowest sequences
    moved: list[slabfile.FoundSlot] = []
    for block in moving:
        path = ns_dir.joinpath(*block_relpath(block.key))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                data = os.read(fd, block.frame_bytes + 1)
            finally:
                os.close(fd)
            header = framer.parse_header(data)
            framer.check(header, block.key, block_bytes)
            payload = memoryview(data)[header.size :]
            framer.verify(header, payload)
            seq = first_seq + len(moved)
            place = free[-1]
            slabfile.write_slot(fds, place, room, block.key, payload, framer, seq)
        except (OSError, CorruptBlock, ValueError) as exc:
            logger.warning("nvme tier: block file %s not moved into a slot: %s", path, exc)
            continue
        free.pop()
        moved.append(slabfile.FoundSlot(place, seq, block.key))
    if moved and fsync:
        for fd in fds:
            os.fdatasync(fd)
    for block in scan.blocks:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ns_dir.joinpath(*block_relpath(block.key)))
    for top in tops:
        with contextlib.suppress(OSError):  # not empty: what the tier did not write stays
            os.rmdir(top)
    scan.converted = len(moved)
    return moved, scan
