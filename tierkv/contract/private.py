"""Directories a tier keeps files in, private to the user the server runs as.

KV blocks encode prompts, so a tier that keeps them on a local disk keeps them where
no other user can read them or put their own: its files 0600 and the directories it
makes 0700, whatever the umask, and it refuses a directory that other users can write.

The rule for a directory the config names (a tier's `path`), judged on the directory
itself (a symlink to it is followed: the link only says where it is):

- its owner is the server's user or root: the owner of a directory may rename and
  replace anything in it, whatever its mode;
- neither its group nor other users may write it, sticky bit or not: a sticky
  directory (`/tmp`, mode 1777) keeps others from renaming or deleting the tier's
  entries, not from creating their own names first, and a tier names its entries
  deterministically (nvme's namespace directory).

The directories above it are not judged: they only decide which directory the name
reaches, and whichever it reaches must pass. So a private directory under `/tmp`
serves. A directory the tier makes itself (nvme's namespace directory) must be the
server user's own and no one else's to write (`own_directory_problem`). Neither rule
stops root or another process of the same user: see docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

DIRECTORY_MODE = 0o700
"""Directories a tier makes: only the server's user may list, enter or change them."""
FILE_MODE = 0o600
"""Files a tier makes: only the server's user may read or write them."""


def _user_name(uid: int) -> str | None:
    with contextlib.suppress(KeyError, ImportError):
        import pwd

        return pwd.getpwuid(uid).pw_name
    return None


def _user(uid: int) -> str:
    """`name (uid N)`, or `uid N` where the name is unknown."""
    name = _user_name(uid)
    return f"{name} (uid {uid})" if name else f"uid {uid}"


def _group(gid: int) -> str:
    with contextlib.suppress(KeyError, ImportError):
        import grp

        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    return f"gid {gid}"


def other_writers(st: os.stat_result) -> str | None:
    """Who else can write the directory `st` describes besides its owner: `every user`,
    `its group <name>`; None when no one."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        return "every user"
    if mode & stat.S_IWGRP:
        return f"its group {_group(st.st_gid)}"
    return None


def directory_problem(path: str | os.PathLike[str], st: os.stat_result) -> str | None:
    """What makes the directory `path` (whose `stat` is `st`) one other users can write,
    with the fix; None when only the server's user (and root) can. The rule is the
    module docstring's."""
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return (
            f"{path} belongs to another user, {_user(st.st_uid)}, who could replace what "
            f"the tier keeps in it: point the tier at a directory of your own (a missing "
            f"one is made with mode 0700), or give this one to the server's user "
            f"(`chown {_user_name(uid) or uid} {path}`)"
        )
    writers = other_writers(st)
    if writers is None:
        return None
    mode = stat.S_IMODE(st.st_mode)
    return (
        f"{path} can be written by {writers} (mode {mode:04o}), who could put files in "
        f"it or take the tier's names first: run `chmod go-w {path}`, or point the tier "
        "at a directory of your own (a missing one is made with mode 0700)"
    )


def own_directory_problem(path: str | os.PathLike[str], st: os.stat_result) -> str | None:
    """What makes the directory `path`, one the tier made for itself, not the server
    user's alone to write (its owner another user, or others may write it), with the
    fix; None when it is. Its contents cannot be trusted then: the fix is to remove it
    (the tier makes it anew). A mode that only lets others read or enter it is not a
    problem: the tier tightens it (`fchmod` to DIRECTORY_MODE)."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return (
            f"{path} belongs to another user, {_user(st.st_uid)}, not to the server's "
            f"{_user(uid)}: someone else made it, and may have put files in it; remove it "
            f"(`rm -r {path}`, as its owner or root; the tier makes it anew) or give the "
            "tier a `path` of its own"
        )
    writers = other_writers(st)
    if writers is None:
        return None
    mode = stat.S_IMODE(st.st_mode)
    return (
        f"{path} can be written by {writers} (mode {mode:04o}), who may have put files "
        f"in it; remove it (`rm -r {path}`; the tier makes it anew)"
    )


def make_directories(path: Path) -> None:
    """Make `path` and any missing directory above it, each with mode DIRECTORY_MODE
    (a umask may take bits away, never add any). One that exists is left as it is;
    one made meanwhile by someone else is judged by the caller, as any other."""
    missing: list[Path] = []
    here = path
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, DIRECTORY_MODE)
