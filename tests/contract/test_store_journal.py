"""SQLite answers ``PRAGMA journal_mode=WAL`` with the mode it actually put the file in, and keeps
the old one without an error when it cannot give WAL. The store checks that answer (and the
``synchronous`` level it got) and refuses anything but WAL: ``memory`` and ``off`` are not crash
safe, and qgpu's readers, file checks and read-only reader are built for WAL (contract/store.py
``_require_wal``)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from qgpu_runtime.contract import store as schema
from qgpu_runtime.node.store import Store as NodeStore
from qgpu_runtime.node.store import StoreError as NodeStoreError
from qgpu_runtime.standalone.store import Store as HostStore
from qgpu_runtime.standalone.store import StoreError as HostStoreError

REAL_CONNECT = sqlite3.connect


@pytest.fixture
def without_shared_memory(monkeypatch):
    """Every file opened through SQLite's ``unix-none`` VFS (no locking, no shared memory): real
    SQLite then keeps a file it is asked to make WAL in its rollback journal ('delete'), as it does
    wherever it cannot share memory. (``unix-dotfile`` would do too, but it locks ``<db>.lock``,
    the standalone manager's own lock file.)"""
    def connect(path, *args, **kwargs):
        if kwargs.get("uri"):
            return REAL_CONNECT(path, *args, **kwargs)
        return REAL_CONNECT(f"file:{path}?vfs=unix-none", *args, uri=True, **kwargs)
    monkeypatch.setattr(sqlite3, "connect", connect)


def test_a_database_sqlite_keeps_in_memory_is_refused_as_not_crash_safe():
    with pytest.raises(schema.UnsafeJournal, match=r"^:memory:: SQLite journal mode is 'memory', not 'wal' \(not crash safe"):
        schema.open_store(":memory:")


def test_a_file_sqlite_cannot_give_wal_is_refused_naming_the_mode_it_kept(tmp_path: Path, without_shared_memory):
    path = tmp_path / "host.db"
    with pytest.raises(schema.UnsafeJournal, match=r"host\.db: SQLite journal mode is 'delete', not 'wal' "
                                                   r"\(qgpu's concurrent readers and writers and its file checks need WAL\)"):
        schema.open_store(path)
    # nothing was migrated into the file: the refusal comes before the first write
    assert REAL_CONNECT(path).execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)


@pytest.mark.parametrize("opener, error", [(HostStore, HostStoreError), (NodeStore, NodeStoreError)], ids=["standalone", "node"])
def test_both_stores_refuse_a_file_out_of_wal_in_one_line_naming_it(tmp_path: Path, without_shared_memory, opener, error):
    path = tmp_path / "state.db"
    with pytest.raises(error) as caught:
        opener(str(path))
    message = str(caught.value)
    assert str(path) in message and "'delete', not 'wal'" in message and "\n" not in message, message


def test_a_synchronous_level_below_the_one_asked_is_refused(tmp_path: Path, monkeypatch):
    class KeepsSynchronousOff:
        """A connection whose ``PRAGMA synchronous=…`` does not take (SQLite answers that pragma
        with nothing, so only reading it back tells)."""

        def __init__(self, db: sqlite3.Connection) -> None:
            self._db = db

        def execute(self, sql: str, *args):
            if sql.startswith("PRAGMA synchronous="):
                return self._db.execute("PRAGMA synchronous=OFF")
            return self._db.execute(sql, *args)

        def __getattr__(self, name: str):
            return getattr(self._db, name)

    monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: KeepsSynchronousOff(REAL_CONNECT(*a, **k)))
    with pytest.raises(schema.UnsafeJournal, match=r"t\.db: SQLite synchronous is OFF, not FULL as asked"):
        schema.open_store(tmp_path / "t.db")


def test_synchronous_off_is_not_offered():
    with pytest.raises(ValueError, match="OFF is not crash safe"):
        schema.open_store(":memory:", synchronous="OFF")


def test_a_store_in_wal_answers_wal_and_the_level_asked(tmp_path: Path):
    db = schema.open_store(tmp_path / "t.db", synchronous="NORMAL")
    try:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert db.execute("PRAGMA synchronous").fetchone() == (1,)
    finally:
        db.close()
