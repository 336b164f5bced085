"""`qgpu status --standalone-db` as another user, with hostile names and malformed rows."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time

import pytest

from qgpu_runtime.standalone.store import JobRecord, JobShare, Store, StoredCard, process_start_ticks

from .helpers import as_another_user, env, qgpu_done


def _store_with_job(path: str, name: str) -> None:
    store = Store(path)
    store.set_cards([StoredCard(0, "GPU-x", "Tesla T4", 16384)])
    with store.transaction():
        store.insert_job(JobRecord(f"{name}-1", name, "normal", 100, 1024, (JobShare(0, "GPU-x", 100, 1024),), "true",
                                   time.time(), os.getpid(), process_start_ticks(os.getpid()) or 0))
    store.close()


def test_another_user_reads_the_store_after_its_writer_closed_it(open_folder):
    """The last connection removed -wal and -shm; SQLite would create -shm, which a reader who may
    not write the folder cannot: it said "not a qgpu store (attempt to write a readonly database)"."""
    db = os.path.join(open_folder, "host.db")
    _store_with_job(db, "train")
    os.chmod(db, 0o644)
    assert not os.path.exists(db + "-shm")
    done = subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "status", "--standalone-db", db],
                          env=env(), capture_output=True, text=True, timeout=60, preexec_fn=as_another_user(open_folder))
    assert done.returncode == 0, done.stderr
    assert "train(10%/1024MiB)" in done.stdout


def test_a_user_who_cannot_read_the_store_is_told_why(open_folder):
    if os.geteuid() != 0:
        pytest.skip("only root can run a reader of another uid; a file's owner can always read it")
    db = os.path.join(open_folder, "host.db")
    _store_with_job(db, "train")
    os.chmod(db, 0o600)
    done = subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "status", "--standalone-db", db],
                          env=env(), capture_output=True, text=True, timeout=60, preexec_fn=as_another_user(open_folder))
    assert done.returncode == 1 and f"{db}: not readable by uid 65534 (owner uid 0, mode 0600)" in done.stderr, done.stderr


def test_control_characters_in_a_job_name_are_escaped_in_the_table(db):
    _store_with_job(str(db), "ev\x1b[2J\x1b]0;owned\x07\u202e")
    done = qgpu_done("status", "--standalone-db", str(db))
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout and "\u202e" not in done.stdout
    assert " ev\\x1b[2J\\x1b]0;owned\\x07\\u202e(10%/1024MiB)" in done.stdout


def test_a_share_row_of_the_wrong_type_is_named_not_a_traceback(db):
    _store_with_job(str(db), "train")
    con = sqlite3.connect(db)
    con.execute("UPDATE shares SET core_milli='abc'")
    con.commit()
    con.close()
    done = qgpu_done("status", "--standalone-db", str(db))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{db}: shares row of 'train' on card 0: core_milli 'abc' is not an integer >= 0" in done.stderr
