"""Bad flags, settings and database files: one line naming the flag or field, the value and the
rule (exit 2), never a traceback, and a bad job row never stops the manager's loop."""

from __future__ import annotations

import logging
import os
import re
import socket
import sqlite3
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry

from qgpu_runtime.model import AppClass
from qgpu_runtime.standalone.booking import JobRequestError, JobSpec, job_request
from qgpu_runtime.standalone.config import HostConfig, load_config
from qgpu_runtime.standalone.manager import StandaloneManager
from qgpu_runtime.standalone.store import JobRecord, JobShare, Store, process_start_ticks

from .helpers import env, qgpu_done, rows

SIM = ("--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G")


def _one_line_error(done, code: int = 2) -> str:
    assert done.returncode == code, (done.returncode, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    return done.stderr


def _serve(db, *extra: str) -> str:
    """A manager that must refuse to start (a started one would run until the timeout)."""
    return _one_line_error(qgpu_done("manager", "serve", "--standalone", "--dbfile", str(db), *SIM, *extra, timeout=30))


# -- placement (4) -------------------------------------------------------------------------------
def test_an_unknown_placement_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^placement: 'bogus' is not allowed: use one of .*binpack"):
        HostConfig(node_name="h", placement="bogus")


@pytest.mark.parametrize("name", ["", "h\nforged-row", "h\x1b[2J", "h" * 254])
def test_a_node_name_that_is_empty_too_long_or_not_printable_is_refused_naming_the_field(name):
    with pytest.raises(ValueError, match=r"^node_name: .*: must have 1\.\.253 printable characters"):
        HostConfig(node_name=name, gpu_backend="simulated", simulated_gpus="1xT4-16G")
    assert HostConfig(node_name="h" * 253, gpu_backend="simulated", simulated_gpus="1xT4-16G").node_name == "h" * 253


def test_the_manager_refuses_an_unknown_placement_from_the_flag_or_the_file(db, tmp_path):
    assert "placement: 'bogus' is not allowed" in _serve(db, "--placement", "bogus")
    settings = tmp_path / "host.yaml"
    settings.write_text("placement: bogus\n")
    assert "placement: 'bogus' is not allowed" in _serve(db, "--config", str(settings))


def test_qgpu_run_refuses_a_placement_an_older_manager_recorded(db):
    store = Store(str(db))
    with store.transaction():
        store.set_meta("placement", "bogus")
    store.close()
    done = qgpu_done("run", "--dbfile", str(db), *SIM, "--core", "10", "--memory", "1", "--", "true")
    assert "placement: 'bogus' is not allowed" in _one_line_error(done)


# -- unusable databases and rows (5) -------------------------------------------------------------
def _truncated(path):
    Store(str(path)).close()
    path.write_bytes(path.read_bytes()[:5000])


def _random(path):
    path.write_bytes(bytes(range(256)) * 16)


def _directory(path):
    path.mkdir()


def _foreign_jobs_table(path):
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE jobs (owner TEXT, title TEXT)")
    con.commit()
    con.close()


UNUSABLE = [(_truncated, "database disk image is malformed"), (_random, "file is not a database"),
            (_directory, "not a database file"), (_foreign_jobs_table, "not a qgpu standalone database (no such column")]


@pytest.mark.parametrize(("make", "why"), UNUSABLE, ids=[m.__name__.strip("_") for m, _ in UNUSABLE])
def test_qgpu_run_on_an_unusable_database_says_so_in_one_line(db, make, why):
    make(db)
    done = qgpu_done("run", "--dbfile", str(db), *SIM, "--core", "10", "--memory", "1", "--", "true")
    assert _one_line_error(done).startswith(f"qgpu run: --dbfile '{db}': ") and why in done.stderr, done.stderr


@pytest.mark.parametrize(("make", "why"), UNUSABLE, ids=[m.__name__.strip("_") for m, _ in UNUSABLE])
def test_the_manager_on_an_unusable_database_says_so_in_one_line(db, make, why):
    make(db)
    error = _serve(db)
    assert f"--dbfile '{db}'" in error and (why in error or "not a regular file" in error), error


def _live_job(job_id: str) -> JobRecord:
    """A booking this test process supervises, so no reader reaps it."""
    return JobRecord(job_id, job_id, "normal", 100, 1024, (JobShare(0, "GPU-x", 100, 1024),), "true", time.time(),
                     os.getpid(), process_start_ticks(os.getpid()) or 0)


@pytest.mark.parametrize("shares", ['[{"index": 0}]', '{"index": 0}', "not json", '[{"index": "0", "uuid": 1, "core_milli": 1, "memory_mib": 1}]'])
def test_a_malformed_job_row_is_reported_and_skipped_and_the_loop_goes_on(tmp_path, caplog, shares):
    store = Store(str(tmp_path / "host.db"))
    manager = StandaloneManager(store, HostConfig(node_name="h", gpu_backend="simulated", simulated_gpus="1xT4-16G"), CollectorRegistry())
    manager.start()
    try:
        with store.transaction():
            store.insert_job(_live_job("good"))
        con = sqlite3.connect(tmp_path / "host.db")
        con.execute("INSERT INTO jobs VALUES ('bad', 'bad', 'normal', 1, 1, ?, 'x', 1.0, 1, 1, 2, 1, 0)", (shares,))
        con.commit()
        con.close()
        with caplog.at_level(logging.WARNING, logger="qgpu.standalone.store"):
            manager.tick(0.05, 10.0)
            manager.tick(0.05, 20.0)  # reaps too
            assert [j.id for j in store.jobs()] == ["good"]
        assert sum("'bad'" in r.getMessage() for r in caplog.records) == 1  # once, not every tick
        assert "job row 'bad' skipped: shares" in caplog.text
    finally:
        manager.close()
        store.close()


# -- requests for no GPU (6) ---------------------------------------------------------------------
@pytest.mark.parametrize(("core", "memory", "klass"), [(0, None, AppClass.NORMAL), (0, None, AppClass.OFFLINE), (None, 0, AppClass.ONLINE)])
def test_a_request_for_no_gpu_is_refused_naming_the_flags(core, memory, klass):
    with pytest.raises(JobRequestError, match=rf"--class {klass.value}: asks for no GPU: a job needs --core above 0"):
        job_request(JobSpec("j", core, memory, klass))


@pytest.mark.parametrize("flags", [("--core", "0"), ("--core", "0", "--class", "offline"), ("--memory", "0", "--class", "online")])
def test_qgpu_run_for_no_gpu_is_a_usage_error(db, flags):
    done = qgpu_done("run", "--dbfile", str(db), *SIM, *flags, "--", "true")
    assert "asks for no GPU" in _one_line_error(done)


# -- --wait-timeout (7) --------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "1e308", "-1", "0"])
def test_wait_timeout_must_be_finite_above_zero_and_at_most_a_week(db, value):
    done = qgpu_done("run", "--dbfile", str(db), *SIM, "--core", "10", "--memory", "1", "--wait", "--wait-timeout", value, "--", "true")
    assert "--wait-timeout" in _one_line_error(done) and "above 0 and at most 604800" in done.stderr


def test_wait_timeout_without_wait_is_refused(db):
    done = qgpu_done("run", "--dbfile", str(db), *SIM, "--core", "10", "--memory", "1", "--wait-timeout", "5", "--", "true")
    assert "--wait-timeout 5: only with --wait" in _one_line_error(done)


# -- manager flags and settings (8) --------------------------------------------------------------
@pytest.mark.parametrize("port", ["-1", "70000"])
def test_a_metrics_port_out_of_range_is_refused(db, port):
    assert f"--standalone-metrics-port {port}: must be a port 1..65535, or 0 for no metrics" in _serve(db, "--standalone-metrics-port", port)


def test_a_busy_metrics_port_is_refused_before_the_manager_starts(db):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        error = _serve(db, "--standalone-metrics-port", str(port))
    assert f"--standalone-metrics-port {port}: cannot listen on 127.0.0.1:{port}" in error
    assert rows(db, "SELECT count(*) FROM cards") == [(0,)]  # start() never ran


def test_an_unknown_log_level_is_refused(db):
    assert "--log-level 'bogus': not a level: use one of DEBUG" in _serve(db, "--log-level", "bogus")


@pytest.mark.parametrize(("text", "field"), [("simulated_gpus: 5\n", "simulated_gpus: 5"), ("node_name: [a]\n", "node_name: ['a']"),
                                             ("tick_s: true\n", "tick_s: True")])
def test_settings_of_the_wrong_type_are_refused_naming_the_field(tmp_path, text, field):
    settings = tmp_path / "host.yaml"
    settings.write_text("gpu_backend: simulated\n" + ("" if "simulated_gpus" in text else "simulated_gpus: 1xT4-16G\n") + text)
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        load_config(str(settings), {})


def test_a_bare_on_or_off_in_the_file_is_the_mps_mode(tmp_path):
    settings = tmp_path / "host.yaml"
    settings.write_text("mps: on\n")
    assert load_config(str(settings), {}).mps == "on"
    settings.write_text("mps: off\n")
    assert load_config(str(settings), {}).mps == "off"


# Runs the CLI with every file opened through SQLite's unix-none VFS (no locks, no shared memory;
# unix-dotfile would lock `<db>.lock`, the manager's own lock file), where
# real SQLite answers `PRAGMA journal_mode=WAL` with 'delete' and keeps the rollback journal.
_WITHOUT_SHARED_MEMORY = """
import sqlite3, sys
real = sqlite3.connect
def connect(path, *args, **kwargs):
    if kwargs.get("uri"):
        return real(path, *args, **kwargs)
    return real(f"file:{path}?vfs=unix-none", *args, uri=True, **kwargs)
sqlite3.connect = connect
from qgpu_runtime.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["manager", "run"])
def test_a_database_sqlite_keeps_out_of_wal_is_refused_in_one_line_naming_the_mode(db, command):
    argv = (["manager", "serve", "--standalone", "--dbfile", str(db), *SIM] if command == "manager" else
            ["run", "--dbfile", str(db), *SIM, "--core", "10", "--memory", "1", "--", "true"])
    done = subprocess.run([sys.executable, "-c", _WITHOUT_SHARED_MEMORY, *argv], env=env(), capture_output=True, text=True,
                          timeout=60)
    error = _one_line_error(done)
    assert f"--dbfile {db}: SQLite journal mode is 'delete', not 'wal'" in error, error
    assert not rows(db, "SELECT name FROM sqlite_master"), "nothing is written to a file refused"
