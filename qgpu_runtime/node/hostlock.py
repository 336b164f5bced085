"""One node manager per allocation store: an exclusive ``flock`` on ``<dbfile>.lock``.

Two managers on one store (a second ``qgpu manager serve`` by hand beside the DaemonSet's, or a
rolling update that starts the new pod before the old one has gone) would both answer kubelet
(the later registration wins, the earlier keeps its isolation loop), both write the store and both
hold and resume the same containers, each undoing the other's holds. So the manager takes this lock
before it opens the store, registers a plugin or signals a process, and keeps it for its life; the
kernel releases it when the process ends, however it ends, so a crash never leaves it stale. A
second manager waits for it (logging who holds it), as a DaemonSet's new pod waits for the old one
to stop, and exits 0 if it is stopped while waiting.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)


class LockError(OSError):
    """The lock file cannot be opened or locked; the message names the path and the reason."""


def lock_path(dbfile: Path) -> Path:
    return Path(f"{dbfile}.lock")


def holder(path: Path) -> str:
    """The pid the holder wrote into the lock file, or ``unknown``."""
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


def acquire(dbfile: Path, stop: threading.Event, report_every_s: float = 10.0, poll_s: float = 0.2) -> int | None:
    """The open, locked lock file's descriptor (keep it open for the manager's life), or None when
    ``stop`` was set before the lock came free. LockError when the file cannot be opened."""
    path = lock_path(dbfile)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise LockError(f"--dbfile {dbfile}: cannot open its lock file {path}: {exc.strerror or exc}") from None
    waited = 0.0
    reported = -report_every_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if waited - reported >= report_every_s:
                log.warning("another node manager (pid %s, as written in %s) holds the allocation store %s; "
                            "waiting for it to stop (one manager per store)", holder(path), path, dbfile)
                reported = waited
            if stop.wait(poll_s):
                os.close(fd)
                return None
            waited += poll_s
        except OSError as exc:
            os.close(fd)
            raise LockError(f"--dbfile {dbfile}: cannot lock {path}: {exc.strerror or exc}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd
