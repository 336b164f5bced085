"""Who may write the standalone database, and one manager per database.

The file is the manager's only input: it suspends, resumes and kills the process groups the
``jobs`` rows name, as root on a shared host. Whoever can write the file (or replace it, or plant
its ``-wal`` before the manager opens it) can therefore have any process group of the host stopped
or killed, and delete other users' bookings. So the manager creates the file private (0600) and
refuses to start on a file, ``-wal``, ``-shm`` or lock file that is not its own user's or that
group or others may write, or in a directory someone other than its user or root owns or that
group or others may write (a sticky ``/tmp`` included: anyone could create the ``-wal`` first).
The consequence, documented in docs/standalone.md: only the manager's user books jobs.

Two managers on one file would both rewrite cards and policy and both duty-cycle the same jobs;
``claim`` takes an exclusive ``flock`` on ``<dbfile>.lock`` for the manager's lifetime (released by
the kernel however the process ends) and writes the holder's PID into it for the refusal
(contract/store.py's ``hold_lock_file``, which the node manager's lock uses too).
"""

from __future__ import annotations

import os
import stat

from qgpu_runtime.contract.store import LockFileError, LockHeld, hold_lock_file
from qgpu_runtime.standalone.store import StoreError

PRIVATE_MODE = 0o600
LOCK_SUFFIX = ".lock"
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _describe(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}"


def check_directory(path: str, uid: int) -> str:
    """The real directory of ``path`` after checking it and every directory above it; StoreError
    when another user could write it, or could rename it or one above it away (and put their own
    in its place): each one above must be owned by ``uid`` or root and writable by no one else,
    or sticky (``/tmp``: only an entry's owner may rename it)."""
    folder = os.path.dirname(os.path.realpath(path))
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        raise StoreError(f"--dbfile {path!r}: directory {folder!r} does not exist") from None
    except OSError as err:
        raise StoreError(f"--dbfile {path!r}: cannot read directory {folder!r}: {err.strerror}") from None
    owners = "root" if uid == 0 else f"uid {uid} or root"
    if st.st_uid not in (uid, 0) or st.st_mode & _OTHERS_WRITE:
        raise StoreError(
            f"--dbfile {path!r}: its directory {folder!r} has {_describe(st)}: the manager signals the process groups "
            f"its database names, so the directory must be owned by {owners} and writable by no one else (chmod go-w)")
    above = os.path.dirname(folder)
    while True:
        try:
            st = os.stat(above)
        except OSError as err:
            raise StoreError(f"--dbfile {path!r}: cannot read {above!r}, above its directory: {err.strerror}") from None
        if st.st_uid not in (uid, 0) or (st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX):
            raise StoreError(
                f"--dbfile {path!r}: {above!r}, above its directory, has {_describe(st)}: whoever may write it can "
                f"rename the database's directory and put their own in its place, so it must be owned by {owners} "
                "and writable by no one else, or sticky")
        if above == os.path.dirname(above):
            return folder
        above = os.path.dirname(above)


def check_file(path: str, name: str, uid: int) -> None:
    """StoreError unless ``name`` (the database or one of its companions) is absent or a regular
    file of ``uid`` that group and others cannot write."""
    try:
        st = os.lstat(name)
    except FileNotFoundError:
        return
    except OSError as err:
        raise StoreError(f"--dbfile {path!r}: cannot read {name!r}: {err.strerror}") from None
    if stat.S_ISDIR(st.st_mode) and name == os.path.realpath(path):
        raise StoreError(f"--dbfile {path!r}: is a directory, not a database file")
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_mode & _OTHERS_WRITE:
        what = "" if name == os.path.realpath(path) else f" ({os.path.basename(name)})"
        kind = "" if stat.S_ISREG(st.st_mode) else "not a regular file, "
        raise StoreError(
            f"--dbfile {path!r}{what}: {kind}{_describe(st)}: the manager signals the process groups this file names, so "
            f"it must be a file of uid {uid} that no one else may write (chown {uid}; chmod 0600)")


def ensure_private(path: str, uid: int | None = None) -> None:
    """Create the database 0600 if it does not exist, then check it, its ``-wal``, ``-shm`` and
    lock file and its directory (SQLite gives ``-wal`` and ``-shm`` the database's mode)."""
    uid = os.geteuid() if uid is None else uid
    check_directory(path, uid)
    real = os.path.realpath(path)
    try:
        os.close(os.open(real, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_MODE))
    except FileExistsError:
        pass
    except OSError as err:
        raise StoreError(f"--dbfile {path!r}: cannot create it: {err.strerror}") from None
    for name in (real, real + "-wal", real + "-shm", real + LOCK_SUFFIX):
        check_file(path, name, uid)


class ManagerLock:
    """The exclusive claim of one manager on one database, held until :meth:`release` or exit."""

    def __init__(self, path: str):
        self.path = os.path.realpath(path) + LOCK_SUFFIX
        try:
            self._fd = hold_lock_file(self.path)
        except LockFileError as exc:
            what = "cannot open its lock file" if exc.opening else "cannot lock"
            raise StoreError(f"--dbfile {path!r}: {what} {self.path!r}: {exc.error.strerror or exc.error}") from None
        except LockHeld as exc:
            raise StoreError(f"--dbfile {path!r}: another manager (pid {exc.holder or 'unknown'}) holds {self.path!r}: "
                             "one manager per database; stop that one first or use another --dbfile") from None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the file stays: removing it would let a newcomer lock another inode
            self._fd = -1


def resolve(path: str) -> str:
    """``path`` with every symbolic link resolved, once: the checks, the lock, the database and its
    MPS folder then all name the same file. Resolved again at each use, a link in a folder another
    user may write (``/tmp``) could be pointed elsewhere between the check and the open."""
    return os.path.realpath(path)


def claim(path: str) -> ManagerLock:
    """What the manager does before it opens its database: check who may write it, then lock it.
    ``path`` is :func:`resolve`'s; the manager opens the same one."""
    ensure_private(path)
    return ManagerLock(path)
