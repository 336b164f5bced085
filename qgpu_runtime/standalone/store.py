"""The standalone host's state in SQLite: cards, jobs, settings and the isolation event log.

Many `qgpu run` processes and one manager share the file. Every booking is one
``BEGIN IMMEDIATE`` transaction (read jobs, place, insert), so two runs can never both take the
last free share; WAL mode lets readers (`qgpu status`, the manager) proceed meanwhile.

A booking lives exactly as long as its job: while its supervisor (`qgpu run`) lives, or its job
leader, or any other process of the job's session (the job runs in a session of its own, whose ID
is the leader's PID). A job whose processes are all gone is reaped by the next reader. PIDs are
reused, so a process is named by PID **and** the kernel's start time; a session ID cannot be reused
while any process still belongs to that session (the kernel keeps the number reserved).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import stat
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from qgpu_runtime.contract.store import SchemaError, UnsafeJournal, open_store, transaction
from qgpu_runtime.isolation.procfs import stat_fields
from qgpu_runtime.isolation.watchdog import IsolationEvent
from qgpu_runtime.model import AppClass

log = logging.getLogger("qgpu.standalone.store")


class StoreError(RuntimeError):
    """The database is unusable for this version or this host; the message says what to do."""


@dataclass(frozen=True)
class StoredCard:
    index: int
    uuid: str
    model: str
    memory_mib: int


@dataclass(frozen=True)
class JobShare:
    index: int
    uuid: str
    core_milli: int
    memory_mib: int


@dataclass(frozen=True)
class JobRecord:
    id: str
    name: str
    klass: str
    core_milli: int
    memory_mib: int
    shares: tuple[JobShare, ...]
    command: str
    created: float
    supervisor_pid: int
    supervisor_start: int
    pgid: int | None = None
    pgid_start: int | None = None
    exclusive: bool = False


@dataclass(frozen=True)
class ProcessInfo:
    """One live process as /proc/PID/stat shows it."""
    pid: int
    session: int
    start: int  # clock ticks since boot


def _stat_fields(pid: int | str, proc: str = "/proc", exited_too: bool = False) -> list[bytes] | None:
    """Fields 3.. of /proc/PID/stat (isolation/procfs.py's ``stat_fields``), or None when the
    process is gone or (unless ``exited_too``) a zombie."""
    where = f"{proc}/{pid}/stat"
    try:
        with open(where, "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    try:
        fields = stat_fields(raw, where)
    except ValueError:
        return None  # not a stat line as the kernel writes one: nothing to believe
    if not all(fields[i].isdigit() for i in (3, 17, 19)):
        return None
    # exited (only its status is left to collect); a "zombie" main thread with other threads still
    # running (pthread_exit in main) is a live process
    if not exited_too and (fields[0] == b"X" or (fields[0] == b"Z" and int(fields[17]) <= 1)):
        return None
    return fields


def process_start_ticks(pid: int, exited_too: bool = False) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None when it does not exist
    (or has exited, unless ``exited_too``: a parent reads its own child's even if it just ended).

    Pids are reused; pid + start time names one process for the life of the host.
    """
    fields = _stat_fields(pid, exited_too=exited_too)
    return None if fields is None else int(fields[19])


def alive(pid: int | None, start: int | None) -> bool:
    return pid is not None and start is not None and process_start_ticks(pid) == start


def session_members(proc: str = "/proc") -> dict[int, list[ProcessInfo]]:
    """Every live process of the host, by session ID: one pass over ``proc``."""
    members: dict[int, list[ProcessInfo]] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return members
    for name in sorted((n for n in names if n.isdigit()), key=int):
        fields = _stat_fields(name, proc)
        if fields is None:
            continue
        info = ProcessInfo(int(name), int(fields[3]), int(fields[19]))
        members.setdefault(info.session, []).append(info)
    return members


def job_processes(job: "JobRecord", sessions: Mapping[int, list[ProcessInfo]],
                  start_of: Callable[[int], int | None] = process_start_ticks) -> list[ProcessInfo]:
    """The live processes of ``job``'s session, its leader included; empty when the job is over.

    If the leader's PID now names a process with another start time, the session ended before
    (the kernel reuses a PID only once no process uses it as a session ID) and nothing is the
    job's. A process in the session that started before the leader cannot be the job's either.
    """
    if not job.pgid or job.pgid_start is None:
        return []
    now = start_of(job.pgid)
    if now is not None and now != job.pgid_start:
        return []
    return [p for p in sessions.get(job.pgid, ()) if p.start >= job.pgid_start]


_COLUMNS = {
    "meta": "key, value",
    "cards": "card_index, uuid, model, memory_mib",
    "jobs": "id, name, klass, core_milli, memory_mib, shares, command, created, supervisor_pid, supervisor_start, "
            "pgid, pgid_start, exclusive",
    "shares": "workload_id, namespace, workload, container, card_index, card_uuid, core_milli, memory_mib, class, created_ns",
    "events": "time, job, card, reason, message",
    "usage": "workload_id, container, card_index, sm_pct, memory_mib, sampled",
}
"""The columns this module reads and writes, per table: a file whose table of that name lacks one
is somebody else's database, refused when opened rather than failing at the first booking."""

MAX_SHARES = 64
"""Cards one job may name: more than any host holds."""


def unwritable(path: str) -> str | None:
    """Why the current user cannot book through ``path`` (an existing file it may not write), or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if os.access(path, os.W_OK):
        return None
    return (f"--dbfile {path!r}: not writable by uid {os.getuid()} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): "
            "jobs are booked by writing this file and only the manager's user may write it; run as that user (e.g. with sudo)")


def unusable(path: str, err: sqlite3.Error) -> str:
    """One line for a database SQLite cannot use: the file, SQLite's reason and what to do."""
    if "readonly" in str(err):
        return (f"--dbfile {path!r}: cannot write it ({err}): the file, its -wal/-shm or its directory is read-only "
                f"for uid {os.getuid()}; run as the manager's user")
    return (f"--dbfile {path!r}: not a usable qgpu database ({err}): move it aside or point --dbfile at another file "
            "(the manager creates a new one)")


class Store:
    """One connection to the standalone database. Not shared between threads."""

    def __init__(self, path: str, timeout_s: float = 60.0):
        self.path = path
        self._reported: set[str] = set()  # ids of malformed job rows already logged
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise StoreError(f"--dbfile {path!r}: directory {parent!r} does not exist")
        if os.path.isdir(path):
            raise StoreError(f"--dbfile {path!r}: is a directory, not a database file")
        refused = unwritable(path)
        if refused:
            raise StoreError(refused)
        try:
            self._db = open_store(path, synchronous="NORMAL", timeout_s=timeout_s)
        except (SchemaError, UnsafeJournal) as exc:
            raise StoreError(f"--dbfile {exc}") from None
        except sqlite3.Error as exc:
            raise StoreError(unusable(path, exc)) from None
        try:
            for table, columns in _COLUMNS.items():
                self._db.execute(f"SELECT {columns} FROM {table} LIMIT 0")
        except sqlite3.Error as exc:
            self._db.close()
            raise StoreError(f"--dbfile {path!r}: not a qgpu standalone database ({exc}): move it aside or point "
                             "--dbfile at another file") from None

    def close(self) -> None:
        self._db.close()

    def transaction(self):
        """One ``BEGIN IMMEDIATE`` transaction (re-entrant), the contract's helper."""
        return transaction(self._db)

    # -- settings and inventory ----------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value", (key, value))

    def delete_meta(self, key: str) -> None:
        self._db.execute("DELETE FROM meta WHERE key=?", (key,))

    def cards(self) -> list[StoredCard]:
        return [StoredCard(*r) for r in self._db.execute("SELECT card_index, uuid, model, memory_mib FROM cards ORDER BY card_index")]

    def set_cards(self, cards: Sequence[StoredCard]) -> None:
        """Record the host's cards. Changing the inventory under live jobs is refused: their
        bookings would point at cards that may no longer exist."""
        with self.transaction():
            current = self.cards()
            if current == list(cards):
                return
            if current and self._live_jobs():
                raise StoreError(
                    f"--dbfile {self.path!r}: the host's cards changed ({len(current)} recorded, {len(cards)} now) "
                    "while jobs are running; stop them (or use another --dbfile) first")
            self._db.execute("DELETE FROM cards")
            self._db.executemany("INSERT INTO cards (card_index, uuid, model, memory_mib) VALUES (?, ?, ?, ?)",
                                 [(c.index, c.uuid, c.model, c.memory_mib) for c in cards])

    # -- jobs ---------------------------------------------------------------------------------------
    def _rows(self) -> Iterator[JobRecord]:
        """Every job row this version can read; a malformed one is logged once and skipped (one
        bad row must neither stop the manager's loop nor every booking)."""
        for r in self._db.execute(f"SELECT {_COLUMNS['jobs']} FROM jobs ORDER BY created, id"):
            try:
                yield decode_job(r)
            except ValueError as err:
                key = repr(r[0])
                if key not in self._reported:
                    self._reported.add(key)
                    log.warning("--dbfile %s: job row %s skipped: %s", self.path, key, err)

    def _live_jobs(self) -> list[JobRecord]:
        sessions = _LazySessions()
        return [j for j in self._rows() if self._job_alive(j, sessions)]

    @staticmethod
    def _job_alive(job: JobRecord, sessions: "_LazySessions") -> bool:
        if alive(job.supervisor_pid, job.supervisor_start) or alive(job.pgid, job.pgid_start):
            return True
        # supervisor and leader gone (`kill -9` of `qgpu run` takes the leader with it): the job
        # lives on in any child left in its session
        return bool(job.pgid) and bool(job_processes(job, sessions.get()))

    def reap(self) -> list[JobRecord]:
        """Delete bookings whose supervisor and processes are all gone; returns them. Call inside a transaction."""
        sessions = _LazySessions()
        dead = [j for j in self._rows() if not self._job_alive(j, sessions)]
        for j in dead:
            self.delete_job(j.id)
        return dead

    def jobs(self) -> list[JobRecord]:
        """Live jobs, after reaping the dead ones."""
        with self.transaction():
            self.reap()
            return list(self._rows())

    def booked_jobs(self) -> list[JobRecord]:
        """Every booking as stored, without reaping; for use inside a transaction that reaped first."""
        return list(self._rows())

    def insert_job(self, job: JobRecord) -> None:
        self._db.execute(
            "INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job.id, job.name, job.klass, job.core_milli, job.memory_mib,
             json.dumps([s.__dict__ for s in job.shares]), job.command, job.created,
             job.supervisor_pid, job.supervisor_start, job.pgid, job.pgid_start, int(job.exclusive)),
        )
        self._db.executemany(
            "INSERT INTO shares VALUES (?, '', ?, '', ?, ?, ?, ?, ?, ?)",
            [(job.id, job.name, s.index, s.uuid, s.core_milli, s.memory_mib, job.klass, int(job.created * 1e9)) for s in job.shares],
        )

    def set_job_process(self, job_id: str, pgid: int, pgid_start: int) -> None:
        self._db.execute("UPDATE jobs SET pgid=?, pgid_start=? WHERE id=?", (pgid, pgid_start, job_id))

    def delete_job(self, job_id: str) -> None:
        with self.transaction():
            self._db.execute("DELETE FROM jobs WHERE id=?", (job_id,))
            self._db.execute("DELETE FROM shares WHERE workload_id=?", (job_id,))

    # -- usage ----------------------------------------------------------------------------------
    def write_usage(self, jobs: Mapping[tuple[str, int], tuple[int, int]], cards: Mapping[int, tuple[int, int]],
                    sampled: float) -> None:
        """Replace what was last sampled as used: per (job, card) and per card, (SM %, memory MiB)
        (the ``usage`` table of contract/store.py, read by `qgpu status`)."""
        with self.transaction():
            self._db.execute("DELETE FROM usage")
            self._db.executemany("INSERT INTO usage VALUES (?, '', ?, ?, ?, ?)",
                                 [(job, card, sm, mib, sampled) for (job, card), (sm, mib) in sorted(jobs.items())])
            self._db.executemany("INSERT INTO usage VALUES ('', '', ?, ?, ?, ?)",
                                 [(card, sm, mib, sampled) for card, (sm, mib) in sorted(cards.items())])

    # -- events ---------------------------------------------------------------------------------
    def emit(self, event: IsolationEvent) -> None:
        """EventSink for the memory watchdog: a durable record `qgpu status` and users can read."""
        self._db.execute("INSERT INTO events (time, job, card, reason, message) VALUES (?, ?, ?, ?, ?)",
                         (event.time, event.key, event.card, event.reason, event.message))

    def events(self, job: str | None = None) -> list[IsolationEvent]:
        sql = "SELECT time, job, card, reason, message FROM events"
        rows = self._db.execute(sql + " WHERE job=? ORDER BY id", (job,)) if job else self._db.execute(sql + " ORDER BY id")
        return [IsolationEvent(r[0], r[1], r[2], r[3], r[4]) for r in rows]


def _int(field: str, value: Any, low: int = 0) -> int:
    if type(value) is not int or value < low:
        raise ValueError(f"{field}: {value!r} is not an integer >= {low}")
    return value


def _text(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field}: {value!r} is not text")
    return value


def _share(raw: Any) -> JobShare:
    if not isinstance(raw, dict) or set(raw) != {"index", "uuid", "core_milli", "memory_mib"}:
        raise ValueError(f"shares: {raw!r} is not an object of index, uuid, core_milli and memory_mib")
    return JobShare(_int("shares.index", raw["index"]), _text("shares.uuid", raw["uuid"]),
                    _int("shares.core_milli", raw["core_milli"]), _int("shares.memory_mib", raw["memory_mib"]))


def decode_job(row: Sequence[Any]) -> JobRecord:
    """A ``jobs`` row as a JobRecord, every field checked; ValueError names the field and value.

    Process group IDs 0 and 1 are refused: signalling them would reach the manager's own group or
    init's."""
    try:
        shares = json.loads(_text("shares", row[5]))
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"shares: not JSON ({err})") from None
    if not isinstance(shares, list) or not 0 < len(shares) <= MAX_SHARES:
        raise ValueError(f"shares: must be a list of 1..{MAX_SHARES} shares")
    klass = _text("klass", row[2])
    if klass not in {c.value for c in AppClass}:
        raise ValueError(f"klass: {klass!r} is not one of {', '.join(c.value for c in AppClass)}")
    created = row[7]
    if type(created) not in (int, float) or not math.isfinite(created):
        raise ValueError(f"created: {created!r} is not a time")
    pgid, pgid_start = row[10], row[11]
    if pgid is not None:
        pgid = _int("pgid", pgid, low=2)
        pgid_start = _int("pgid_start", pgid_start)
    elif pgid_start is not None:
        raise ValueError(f"pgid_start: {pgid_start!r} without a pgid")
    return JobRecord(
        id=_text("id", row[0]), name=_text("name", row[1]), klass=klass,
        core_milli=_int("core_milli", row[3]), memory_mib=_int("memory_mib", row[4]),
        shares=tuple(_share(s) for s in shares), command=_text("command", row[6]), created=float(created),
        supervisor_pid=_int("supervisor_pid", row[8]), supervisor_start=_int("supervisor_start", row[9]),
        pgid=pgid, pgid_start=pgid_start, exclusive=bool(_int("exclusive", row[12])))


class _LazySessions:
    """The host's sessions, read from /proc at most once and only when a job needs them."""

    def __init__(self) -> None:
        self._members: dict[int, list[ProcessInfo]] | None = None

    def get(self) -> dict[int, list[ProcessInfo]]:
        if self._members is None:
            self._members = session_members()
        return self._members
