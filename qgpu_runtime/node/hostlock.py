"""One node manager per allocation store: an exclusive ``flock`` on ``<dbfile>.lock``.

Two managers on one store (a second ``qgpu manager serve`` by hand beside the DaemonSet's, or a
rolling update that starts the new pod before the old one has gone) would both answer kubelet
(the later registration wins, the earlier keeps its isolation loop), both write the store and both
hold and resume the same containers, each undoing the other's holds. So the manager takes this lock
before it opens the store, registers a plugin or signals a process, and keeps it for its life; the
kernel releases it when the process ends, however it ends, so a crash never leaves it stale. A
second manager waits for it (logging who holds it), as a DaemonSet's new pod waits for the old one
to stop, and exits 0 if it is stopped while waiting. The lock itself is contract/store.py's
``hold_lock_file``, which the standalone manager's lock uses too (a second one is refused).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from qgpu_runtime.contract.store import LockFileError, hold_lock_file

log = logging.getLogger(__name__)


class LockError(OSError):
    """The lock file cannot be opened or locked; the message names the path and the reason."""


def lock_path(dbfile: Path) -> Path:
    """The lock file of the database ``dbfile`` names, its links resolved: two names of one
    database (a link, a relative path) are one lock, as the standalone manager's (standalone/dbfile.py)."""
    return Path(f"{os.path.realpath(dbfile)}.lock")


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

    def waiting() -> None:
        log.warning("another node manager (pid %s, as written in %s) holds the allocation store %s; "
                    "waiting for it to stop (one manager per store)", holder(path), path, dbfile)

    try:
        return hold_lock_file(path, make_parents=True, stop=stop, poll_s=poll_s, waiting=waiting,
                              report_every_s=report_every_s)
    except LockFileError as exc:
        what = f"cannot open its lock file {path}" if exc.opening else f"cannot lock {path}"
        raise LockError(f"--dbfile {dbfile}: {what}: {exc.error.strerror or exc.error}") from None
