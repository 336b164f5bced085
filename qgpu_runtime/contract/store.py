"""The store's schema: one definition for the node manager's and the standalone host's SQLite file.

Two writers share the layout because one reader serves both: `qgpu status` reads ``meta``,
``cards`` and ``shares`` of either file (``read_status``). The node manager adds ``grants`` (what
kubelet handed out), the standalone host ``jobs`` and ``events``; every file has every table, so a
table is never missing for the kind that does not use it, and no reader needs to know which kind
of file it opened.

Versions: ``meta.schema_version`` names the file's version. ``open_store`` applies the migrations
from the file's version up to ``SCHEMA_VERSION`` in one ``BEGIN IMMEDIATE`` transaction (all or
nothing, and two processes opening one file at once migrate it once), and refuses a file written
by a newer qgpu: it cannot know what that version changed. A migration that only adds tables or
columns keeps the version readable by the previous release; one that changes a column's meaning
bumps ``SCHEMA_VERSION`` (docs/node-manager.md, "Store schema").

Also here: the transaction helper both stores use (``transaction``), the pragmas (WAL,
synchronous) every connection gets and whose answers it checks (``UnsafeJournal``), and the lock
file that keeps one manager per store (``hold_lock_file``: an exclusive ``flock`` on
``<dbfile>.lock``, which a second node manager waits for and a second standalone manager is
refused by).
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, overload

SCHEMA_VERSION = 1
"""The version this qgpu writes and the newest it reads."""


class SchemaError(RuntimeError):
    """The file cannot be used with this qgpu's schema; the message names the file, version and rule."""


class UnsafeJournal(RuntimeError):
    """SQLite kept the file out of WAL mode, or below the asked ``synchronous`` level; the message
    names the file, the setting SQLite answered and why it matters."""


# Version 1: the tables of qgpu 0.1.0, the node manager's and the standalone host's together
# (0.1.0 created the common three in both and the kind's own in each; CREATE IF NOT EXISTS adds
# the other kind's, which that release never reads).
_TABLES_V1 = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS cards (
        card_index INTEGER PRIMARY KEY, uuid TEXT NOT NULL UNIQUE, model TEXT NOT NULL, memory_mib INTEGER NOT NULL,
        healthy INTEGER NOT NULL DEFAULT 1, reason TEXT NOT NULL DEFAULT '')""",
    """CREATE TABLE IF NOT EXISTS shares (
        workload_id TEXT NOT NULL, namespace TEXT NOT NULL, workload TEXT NOT NULL, container TEXT NOT NULL,
        card_index INTEGER NOT NULL, card_uuid TEXT NOT NULL, core_milli INTEGER NOT NULL, memory_mib INTEGER NOT NULL,
        class TEXT NOT NULL, created_ns INTEGER NOT NULL, PRIMARY KEY (workload_id, container, card_index))""",
    """CREATE TABLE IF NOT EXISTS grants (
        pod_uid TEXT NOT NULL, namespace TEXT NOT NULL, pod TEXT NOT NULL, container TEXT NOT NULL,
        resource TEXT NOT NULL, device_ids TEXT NOT NULL, created_ns INTEGER NOT NULL,
        PRIMARY KEY (pod_uid, container, resource))""",
    """CREATE TABLE IF NOT EXISTS jobs (
        id TEXT PRIMARY KEY, name TEXT NOT NULL, klass TEXT NOT NULL, core_milli INTEGER NOT NULL,
        memory_mib INTEGER NOT NULL, shares TEXT NOT NULL, command TEXT NOT NULL, created REAL NOT NULL,
        supervisor_pid INTEGER NOT NULL, supervisor_start INTEGER NOT NULL,
        pgid INTEGER, pgid_start INTEGER, exclusive INTEGER NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, job TEXT NOT NULL, card INTEGER NOT NULL,
        reason TEXT NOT NULL, message TEXT NOT NULL)""",
    # Added after 0.1.0, without a version bump because it is a table only (the rule above): the
    # ResourceClaims the DRA kubelet plugin prepared (node/dra/preparer.py). Their card shares are
    # ordinary ``shares`` rows whose workload_id is the claim's UID, so every reader of version 1
    # sees them; this table adds what kubelet is answered again on a repeated prepare (``devices``,
    # JSON) and the CDI spec file to remove. 0.1.0 refuses any version but "1", so a bump here
    # would have made a rollback of the manager over its own store fail.
    """CREATE TABLE IF NOT EXISTS claims (
        claim_uid TEXT PRIMARY KEY, namespace TEXT NOT NULL, name TEXT NOT NULL, devices TEXT NOT NULL,
        cdi_spec TEXT NOT NULL, created_ns INTEGER NOT NULL)""",
    # Added after the claims table, a table only again: the pods a prepared claim is reserved for
    # (its ``status.reservedFor`` at prepare), so the isolation loop finds the claim's containers
    # after a restart without the apiserver. A separate table, not a column of ``claims``: a
    # manager rolled back to the release before writes ``claims`` rows with six values, which a
    # seventh column would refuse; it never reads this table, and rows it leaves behind for a claim
    # it released name a claim no longer booked, which every reader skips.
    """CREATE TABLE IF NOT EXISTS claim_pods (
        claim_uid TEXT NOT NULL, pod_uid TEXT NOT NULL, namespace TEXT NOT NULL, pod TEXT NOT NULL,
        PRIMARY KEY (claim_uid, pod_uid))""",
    # Added after claim_pods, a table only again: what the standalone manager last sampled as used,
    # per share (workload_id, container, card_index of a ``shares`` row) and, with workload_id ''
    # and container '', per card (every card, idle ones at 0). ``sm_pct`` is the mean over the last write interval, ``memory_mib``
    # the latest; ``sampled`` the writer's wall clock. Rewritten whole at each write; a release that
    # never reads it leaves it as it is.
    """CREATE TABLE IF NOT EXISTS usage (
        workload_id TEXT NOT NULL, container TEXT NOT NULL, card_index INTEGER NOT NULL, sm_pct INTEGER,
        memory_mib INTEGER, sampled REAL NOT NULL, PRIMARY KEY (workload_id, container, card_index))""",
)


def _to_v1(db: sqlite3.Connection) -> None:
    for statement in _TABLES_V1:
        db.execute(statement)


@dataclass(frozen=True)
class Migration:
    version: int
    why: str
    apply: Callable[[sqlite3.Connection], None]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "the tables of both kinds of store (a new file, or a 0.1.0 file of either kind)", _to_v1),
)
"""Ordered; migration N brings a file from version N-1 (0: no version yet) to N. Re-applying
the last one to a file already at its version is harmless (CREATE IF NOT EXISTS), which is how a
0.1.0 file gets the other kind's tables."""

assert [m.version for m in MIGRATIONS] == list(range(1, SCHEMA_VERSION + 1))


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` … ``COMMIT``, rolled back on any exception.

    IMMEDIATE takes the write lock up front, so a read-then-write (place a job, record an
    Allocate) cannot interleave with another writer. Re-entrant: inside an open transaction it
    adds nothing, and the outer one commits or rolls back.

    A ``COMMIT`` that fails (a full disk, an I/O error, a deferred constraint) may leave SQLite's
    transaction open; it is rolled back before the error goes on. Left open, every later
    ``transaction()`` took the re-entrant branch above: its writes were never committed, while the
    caller (Allocate answering kubelet, a standalone booking) believed them durable.
    """
    if db.in_transaction:
        yield
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    try:
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


class LockFileError(Exception):
    """The lock file cannot be opened (``opening``; its folder created, too, with ``make_parents``)
    or locked for a reason other than another holder; ``error`` is the OSError, for the caller's
    message."""

    def __init__(self, error: OSError, opening: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.opening = opening


class LockHeld(Exception):
    """Another process holds the lock file; ``holder`` is what it wrote there (its pid), '' if nothing."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


@overload
def hold_lock_file(path: str | Path, *, make_parents: bool = ..., stop: None = ..., poll_s: float = ...,
                   waiting: Callable[[], None] | None = ..., report_every_s: float = ...) -> int: ...
@overload
def hold_lock_file(path: str | Path, *, make_parents: bool = ..., stop: threading.Event, poll_s: float = ...,
                   waiting: Callable[[], None] | None = ..., report_every_s: float = ...) -> int | None: ...
def hold_lock_file(path: str | Path, *, make_parents: bool = False, stop: threading.Event | None = None,
                   poll_s: float = 0.2, waiting: Callable[[], None] | None = None,
                   report_every_s: float = 10.0) -> int | None:
    """One manager per store: open ``path`` (created 0600, never through a symlink), take an
    exclusive ``flock`` on it and write this process's pid into it. Returns the descriptor, to keep
    open for as long as the lock is held; the kernel releases the lock when it is closed or the
    process ends, however it ends, so a crash never leaves it stale (the file stays: removing it
    would let a newcomer lock another inode).

    Held by another process: without ``stop``, LockHeld at once (the standalone manager refuses);
    with it, the lock is tried again every ``poll_s`` seconds, calling ``waiting`` when the wait
    begins and every ``report_every_s`` seconds after, until it comes free (the descriptor) or
    ``stop`` is set (None; the node manager waits). LockFileError when the file cannot be opened
    or locked."""
    path = Path(path)
    try:
        if make_parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise LockFileError(exc, opening=True) from None
    waited = 0.0
    reported = -report_every_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if stop is None:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                raise LockHeld(holder) from None
            if waiting is not None and waited - reported >= report_every_s:
                waiting()
                reported = waited
            if stop.wait(poll_s):
                os.close(fd)
                return None
            waited += poll_s
        except OSError as exc:
            os.close(fd)
            raise LockFileError(exc, opening=False) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd


def file_version(db: sqlite3.Connection) -> int | None:
    """The file's schema version; None for a file without one (new, or not a qgpu store yet)."""
    try:
        row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.OperationalError:  # no meta table
        return None
    if row is None:
        return None
    try:
        return int(row[0])
    except ValueError:
        raise SchemaError(f"schema_version={row[0]!r}: not a version number") from None


SYNCHRONOUS_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")
"""``PRAGMA synchronous`` by the number SQLite answers it with."""


def _require_wal(db: sqlite3.Connection, path: str | Path, answered: object, synchronous: str) -> None:
    """Check what SQLite answered, not what was asked: ``PRAGMA journal_mode=WAL`` returns the mode
    in effect, and a file SQLite cannot give WAL (an in-memory or temporary database, a VFS without
    shared memory) stays in the mode it had, without an error.

    Only WAL is accepted. ``memory`` and ``off`` are not crash safe: a process killed in the middle
    of a transaction leaves the file half written, and a booking or grant can be lost or doubled.
    The rollback journals (``delete``, ``truncate``, ``persist``) are crash safe, but every reader
    then blocks writers and the reverse (the standalone manager reads every tick while `qgpu run`
    books), and the file checks (``-wal``/``-shm``) and `qgpu status`'s read-only reader are built
    for WAL; refusing is one clear line where a quiet fallback would change all three."""
    mode = str(answered).lower()
    if mode != "wal":
        why = ("not crash safe: a process killed mid-transaction can leave the file corrupt and a booking lost"
               if mode in ("memory", "off") else
               "qgpu's concurrent readers and writers and its file checks need WAL")
        raise UnsafeJournal(f"{path}: SQLite journal mode is {mode!r}, not 'wal' ({why}); put the file on a local "
                            "filesystem SQLite can share memory on (WAL needs it), not in memory")
    level = db.execute("PRAGMA synchronous").fetchone()[0]
    got = SYNCHRONOUS_LEVELS[level] if isinstance(level, int) and 0 <= level < len(SYNCHRONOUS_LEVELS) else repr(level)
    if got != synchronous:
        raise UnsafeJournal(f"{path}: SQLite synchronous is {got}, not {synchronous} as asked: "
                            f"a commit could be lost or the file damaged by a crash")


def open_store(path: str | Path, *, synchronous: str = "FULL", timeout_s: float = 30.0, threads: bool = False) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions through ``transaction``), WAL journal, the
    file migrated to ``SCHEMA_VERSION``. Raises SchemaError for a file of a newer qgpu (naming the
    file, its version and the versions this one reads), UnsafeJournal when SQLite keeps the file
    out of WAL or below ``synchronous`` (NORMAL or above: with WAL both survive a crash of the
    process; FULL survives power loss too) and sqlite3.Error for an unusable file."""
    if synchronous not in ("NORMAL", "FULL", "EXTRA"):
        raise ValueError(f"synchronous={synchronous!r}: must be NORMAL, FULL or EXTRA (OFF is not crash safe)")
    db = sqlite3.connect(str(path), timeout=timeout_s, isolation_level=None, check_same_thread=not threads)
    try:
        answered = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        db.execute(f"PRAGMA synchronous={synchronous}")
        _require_wal(db, path, answered, synchronous)
        with transaction(db):
            try:
                found = file_version(db)
            except SchemaError as exc:
                raise SchemaError(f"{path}: {exc}") from None
            if found is not None and found > SCHEMA_VERSION:
                raise SchemaError(f"{path}: schema version {found} is newer than this qgpu reads (versions 1..{SCHEMA_VERSION}); "
                                  "upgrade qgpu, or point it at another file")
            for migration in MIGRATIONS:
                if found is None or migration.version >= found:
                    migration.apply(db)
            db.execute("INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                       (str(SCHEMA_VERSION),))
    except BaseException:
        db.close()
        raise
    return db


@dataclass(frozen=True)
class StatusRows:
    """What `qgpu status` shows of one store file: settings, cards and every share."""

    meta: dict[str, str]
    cards: list[tuple[int, str, str, int]]  # index, uuid, model, memory MiB
    shares: list[tuple[str, str, str, int, int, int, str]]  # namespace, workload, container, card, core ‰, MiB, class
    used: dict[tuple[str, str, str, int], tuple[int | None, int | None]] = field(default_factory=dict)
    """(namespace, workload, container, card) of a share -> (SM %, memory MiB) last sampled"""
    card_used: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)  # card -> (SM %, MiB)
    sampled: float | None = None  # when the usage rows were written (writer's wall clock); None: never


class UnreadableStore(RuntimeError):
    """The file cannot be opened read-only by this user; the message says why and what to do."""


def _open_read_only(path: str | Path) -> sqlite3.Connection:
    """A read-only connection. A WAL file needs its ``-shm`` to be read, and SQLite creates that
    (writable) when it is missing, which a user who may not write the folder cannot: after the
    writer closed the file, the last connection removed both. With no ``-wal`` left (or an empty
    one) the file itself holds every change, so it is opened ``immutable`` instead: nothing is
    created. While a ``-wal`` holds changes and its ``-shm`` cannot be used, the file is refused
    with that reason rather than read without them."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return db
    except sqlite3.OperationalError as err:
        db.close()
        if "readonly" not in str(err) and "unable to open" not in str(err):
            raise
        try:
            pending = os.path.getsize(f"{path}-wal") > 0
        except FileNotFoundError:
            pending = False
        if pending:
            raise UnreadableStore(f"{path}: cannot open it read-only ({err}): its -wal holds changes and its -shm is not "
                                  f"usable by uid {os.getuid()}; run as the file's owner, or once its writer has closed it") from None
    db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    try:
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except BaseException:
        db.close()
        raise
    return db


def read_status(path: str | Path) -> StatusRows:
    """Read-only (works while a manager writes the file; never migrates or creates anything)."""
    db = _open_read_only(path)
    try:
        found = file_version(db)
        if found is not None and found > SCHEMA_VERSION:
            raise SchemaError(f"{path}: schema version {found} is newer than this qgpu reads (versions 1..{SCHEMA_VERSION})")
        db.execute("BEGIN")  # one snapshot of every table: a writer may rewrite usage meanwhile
        used: dict[tuple[str, str, str, int], tuple[int | None, int | None]] = {}
        card_used: dict[int, tuple[int | None, int | None]] = {}
        sampled = None
        if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='usage'").fetchone():  # absent before it was added
            for ns, workload, container, card, sm, mib in db.execute(
                    "SELECT s.namespace, s.workload, s.container, u.card_index, u.sm_pct, u.memory_mib FROM usage u "
                    "JOIN shares s ON s.workload_id = u.workload_id AND s.container = u.container AND s.card_index = u.card_index"):
                used[(ns, workload, container, card)] = (sm, mib)
            card_used = {card: (sm, mib) for card, sm, mib in
                         db.execute("SELECT card_index, sm_pct, memory_mib FROM usage WHERE workload_id = ''")}
            sampled = db.execute("SELECT max(sampled) FROM usage").fetchone()[0]
        return StatusRows(
            meta=dict(db.execute("SELECT key, value FROM meta").fetchall()),
            cards=db.execute("SELECT card_index, uuid, model, memory_mib FROM cards ORDER BY card_index").fetchall(),
            shares=db.execute("SELECT namespace, workload, container, card_index, core_milli, memory_mib, class "
                              "FROM shares ORDER BY card_index, created_ns, workload, container").fetchall(),
            used=used, card_used=card_used, sampled=sampled)
    finally:
        db.close()
