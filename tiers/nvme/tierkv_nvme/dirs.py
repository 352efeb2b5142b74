"""The fan-out directories' descriptors, kept open for the tier's life.

Every block operation opens, renames or deletes its file relative to a descriptor of
its fan-out directory, so no link below the namespace directory is followed
(`blockfile.py`). Opening that directory for each block and closing it again were two
of the six system calls of a block read; the tier now keeps one descriptor per fan-out
directory (`FanoutDirs`: at most 256 per namespace directory, opened lazily with
`O_NOFOLLOW | O_DIRECTORY` from the namespace directory's descriptor, closed by the
tier's `close`).

A kept descriptor names a directory, not a path: renamed away and replaced (by a link,
or by another directory), it would still reach the old one. So each worker-thread call
(`Leaves`, one per call) checks each directory it uses once, with one `stat` of its
name that does not follow links: the same directory is used as it is; anything else is
opened afresh exactly as before (a link fails ELOOP, a missing directory is
FileNotFoundError, or made anew for a write) and replaces the kept descriptor. The one
replaced stays open, retired, until `close` (another thread may still be using it:
closed now, its number could be handed to an unrelated file meanwhile). So a directory
swapped under the tier is noticed by the next thread call, and within one call (a few
milliseconds) the old one may still be used, as a swap between opening a directory and
its file always could be.

That `stat` per directory is skipped while the namespace directory itself is unchanged
(`FanoutDirs.leaves`): replacing a fan-out directory renames, removes or creates an
entry of the namespace directory, which changes its modification and change times, and
the change time cannot be set back. One `fstat` of it per call decides: the same times
(and inode) as when each kept directory was last checked, and those times settled (at
least SETTLED_NS older than that check, so a change made after it cannot carry the
same timestamp, whatever the filesystem's timestamp granularity): the kept directories
are still the ones their names hold. Anything else, and every directory is checked
again as above. A call of 128 blocks in 128 directories makes one system call
where it made 128 (2-3 us a block on the dev VM); the namespace directory changes when
a fan-out directory is made (at most 256 times in a tier's life), after which the
calls of the next SETTLED_NS check each directory as before.

The namespace directory itself is taken by `open_namespace_dir`, once at `open` (and
again when it vanished): the tier's `path` is made 0700 where missing and opened (a
symlink to it is followed); it must be no other user's to write
(`tierkv.contract.private.directory_problem`); the namespace directory is made in it
0700, or taken as it is, through that descriptor without following a link, and must
be the server user's own and no one else's to write (`own_directory_problem`: one
that only others may read, from tiers before it was made 0700, is tightened to 0700).
Anything else is refused with TierUnavailable, naming the fix: another user who may
write either directory could pre-create the namespace directory, or put blocks in it.

Descriptors are bounded per process (`fd_budget`): the LMCache adapter runs one chain per
object size and SGLang's one per pool, so several tiers may share a process whose
`RLIMIT_NOFILE` soft limit is often 1,024. All the tiers of a process keep at most a
quarter of that limit (256 of 1,024; SGLang and vLLM raise it to 65,535 at start); past
it, a thread call opens the directories it needs once for the call and closes them at
its end, which still costs fewer calls than a directory open per block. tierkv does not
raise the limit itself: that is the process owner's choice.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import stat
import threading
import time
from pathlib import Path
from types import TracebackType

from tierkv.contract.private import (
    DIRECTORY_MODE,
    directory_problem,
    make_directories,
    own_directory_problem,
)
from tierkv.tier import TierUnavailable

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC

Dirs = tuple[str, ...]
"""The fan-out directories of a block's path (its relative path less the file name)."""
SETTLED_NS = 2 * 10**9
"""How much older than a check the namespace directory's timestamps must be for that
check to hold until they change (see the module docstring): 2 s, coarser than any
timestamp granularity of the filesystems a tier lives on (ext4, XFS and btrfs keep
nanoseconds updated per clock tick; FAT keeps 2 s)."""


def no_link(exc: OSError, where: str) -> OSError:
    """A clearer error for a symlink where the tier expects its own directory or file."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return OSError(
            errno.ELOOP,
            f"{where} is a symlink (or not a directory); the nvme tier does not follow "
            "links out of its directory: remove it",
        )
    return exc


def open_dirs(root_fd: int, dirs: Dirs, *, create: bool) -> int:
    """A new descriptor of the directory `dirs` under `root_fd`, walked without following
    symlinks; created when missing and `create`.

    Raises FileNotFoundError when missing and not `create`, OSError(ELOOP) for a link."""
    fd = root_fd
    try:
        for name in dirs:
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            if fd != root_fd:
                os.close(fd)
            fd = child
    except OSError as exc:
        if fd != root_fd:
            os.close(fd)
        raise no_link(exc, "/".join(dirs)) from None
    return fd


NOT_PRIVATE = "nvme tier will not keep blocks where other users can write: "


def open_namespace_dir(path: Path, name: str) -> int:
    """A descriptor of the namespace directory `name` under the tier's `path`, each made
    (mode 0700) where missing, and each checked to be private (the module docstring).

    Raises TierUnavailable for a directory other users may write, or a link where the
    namespace directory should be; OSError as the system calls do (a `path` that is a
    file, a directory the server may not write)."""
    make_directories(path)
    top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)  # `path` may be a link
    try:
        problem = directory_problem(path, os.fstat(top))
        if problem is not None:
            raise TierUnavailable(NOT_PRIVATE + problem)
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, DIRECTORY_MODE, dir_fd=top)
        try:
            root = os.open(name, DIR_FLAGS, dir_fd=top)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise TierUnavailable(
                    f"nvme tier directory {path / name} is a symlink (or not a "
                    "directory); the tier does not follow links: point `path` at the "
                    "real directory"
                ) from None
            raise
    finally:
        os.close(top)
    try:
        held = os.fstat(root)
        problem = own_directory_problem(path / name, held)
        if problem is not None:
            raise TierUnavailable(NOT_PRIVATE + problem)
        if stat.S_IMODE(held.st_mode) & 0o077:  # others may read it: a tier before 0700
            os.fchmod(root, DIRECTORY_MODE)
    except BaseException:
        os.close(root)
        raise
    return root


def fd_budget() -> int:
    """Fan-out directory descriptors all the tiers of this process may keep open: a
    quarter of the soft `RLIMIT_NOFILE` (read at each new descriptor, so a limit raised
    later counts)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(0, soft // 4)


class _Budget:
    """Descriptors kept (and retired) by every `FanoutDirs` of the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0

    def take(self) -> bool:
        with self._lock:
            if self.held >= fd_budget():
                return False
            self.held += 1
            return True

    def give(self, count: int) -> None:
        with self._lock:
            self.held -= count


BUDGET = _Budget()


class FanoutDirs:
    """The kept descriptors of one tier's fan-out directories, below `root_fd` (the
    namespace directory, which the tier owns and closes itself). Thread-safe."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self._kept: dict[Dirs, tuple[int, int, int]] = {}  # -> (fd, st_dev, st_ino)
        self._retired: list[int] = []
        self._lock = threading.Lock()
        self._closed = False
        self._root: tuple[int, int, int] | None = None  # the namespace dir's (ino, mtime, ctime)
        self._generation = 0  # bumped whenever those change
        self._settled = False  # whether they were SETTLED_NS old at a call since
        self._checked: dict[Dirs, int] = {}  # kept dir -> generation it was checked in

    def __len__(self) -> int:
        """Descriptors open: kept and retired."""
        return len(self._kept) + len(self._retired)

    def leaves(self) -> Leaves:
        """The directories of one worker-thread call (use as a context manager)."""
        return Leaves(self, self._generation_now())

    def _generation_now(self) -> int | None:
        """The generation of the namespace directory's state now, when its kept
        directories checked in this generation need no check again; None when each
        directory must be checked (the module docstring)."""
        try:
            now = os.fstat(self.root_fd)
        except OSError:
            return None
        state = (now.st_ino, now.st_mtime_ns, now.st_ctime_ns)
        with self._lock:
            if state != self._root:
                self._root = state
                self._generation += 1
                self._settled = False
            if not self._settled:
                changed = max(now.st_mtime_ns, now.st_ctime_ns)
                self._settled = changed <= time.time_ns() - SETTLED_NS
            return self._generation if self._settled else None

    def checked(
        self, dirs: Dirs, *, create: bool, generation: int | None = None
    ) -> tuple[int, bool]:
        """(a descriptor of `dirs`, checked to be the directory its name holds now,
        whether the caller must close it). With the call's settled `generation`
        (`leaves`), a directory already checked in it is not checked again. Raises as
        `open_dirs`."""
        kept = self._kept.get(dirs)
        if kept is not None and len(dirs) == 1:
            fd, dev, ino = kept
            if generation is not None and self._checked.get(dirs) == generation:
                return fd, False
            try:
                now = os.stat(dirs[0], dir_fd=self.root_fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise
            else:
                if now.st_ino == ino and now.st_dev == dev and stat.S_ISDIR(now.st_mode):
                    if generation is not None:
                        self._checked[dirs] = generation
                    return fd, False
        fd = open_dirs(self.root_fd, dirs, create=create)
        if len(dirs) != 1:  # only the one level the layout writes is kept
            return fd, True
        try:
            opened = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        with self._lock:
            if self._closed:
                return fd, True
            current = self._kept.get(dirs)
            if current is not None:
                if (current[1], current[2]) == (opened.st_dev, opened.st_ino):
                    os.close(fd)  # another thread kept this very directory meanwhile
                    return current[0], False
                del self._kept[dirs]
                self._checked.pop(dirs, None)
                self._retired.append(current[0])  # keeps its share of the budget
            if not BUDGET.take():
                return fd, True
            self._kept[dirs] = (fd, opened.st_dev, opened.st_ino)
            if generation is not None:
                self._checked[dirs] = generation
            return fd, False

    def close(self) -> None:
        """Close every kept and retired descriptor (the tier's jobs have ended).
        Idempotent."""
        with self._lock:
            self._closed = True
            fds = [fd for fd, _dev, _ino in self._kept.values()] + self._retired
            self._kept.clear()
            self._checked.clear()
            self._retired.clear()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        BUDGET.give(len(fds))


class Leaves:
    """The fan-out directories one worker-thread call uses: each checked once
    (`FanoutDirs.checked`), those not kept closed when the call ends."""

    __slots__ = ("_dirs", "_generation", "_owned", "_seen", "root_fd")

    def __init__(self, dirs: FanoutDirs, generation: int | None = None) -> None:
        self._dirs = dirs
        self._generation = generation
        self.root_fd = dirs.root_fd
        self._seen: dict[Dirs, int] = {}
        self._owned: list[int] = []

    def get(self, dirs: Dirs, *, create: bool) -> int:
        """A descriptor of the directory `dirs` (do not close it). Raises
        FileNotFoundError when missing and not `create`, OSError(ELOOP) for a link."""
        fd = self._seen.get(dirs)
        if fd is None:
            fd, owned = self._dirs.checked(dirs, create=create, generation=self._generation)
            if owned:
                self._owned.append(fd)
            self._seen[dirs] = fd
        return fd

    def close(self) -> None:
        owned, self._owned = self._owned, []
        self._seen.clear()
        for fd in owned:
            os.close(fd)

    def __enter__(self) -> Leaves:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
