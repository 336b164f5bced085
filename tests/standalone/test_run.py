"""`qgpu run`: booking through the placement engine, concurrency, release on every kind of exit."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

from qgpu_runtime.standalone.host_status import host_status
from qgpu_runtime.standalone.store import Store
from qgpu_runtime.standalone.supervisor import _Forwarder

from .helpers import job_pgids, proc_state, qgpu, qgpu_done, rows, wait_for

SIM = ("--gpu-backend", "simulated", "--simulated-gpus", "2xT4-16G")


def test_job_gets_its_card_and_quota_in_the_environment_and_its_exit_code_back(db):
    done = qgpu_done("run", "--dbfile", str(db), *SIM, "--core", "30", "--memory", "5", "--",
                     "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES $QGPU_CORE_MILLI $QGPU_MEMORY_MIB"; exit 7')
    assert done.returncode == 7
    uuid, core, memory = done.stdout.split()
    assert uuid.startswith("GPU-") and (core, memory) == ("300", "5120")
    assert rows(db, "SELECT count(*) FROM jobs") == [(0,)] and rows(db, "SELECT count(*) FROM shares") == [(0,)]


def _audit_every_booking(db) -> None:
    """Record, inside each booking's own transaction, what the card holds after it: the store
    itself then proves the claim at every step, however the processes were scheduled."""
    con = sqlite3.connect(db)
    try:
        con.executescript("""
            CREATE TABLE audit (card INTEGER, core_milli INTEGER, memory_mib INTEGER, bookings INTEGER);
            CREATE TRIGGER audit_booking AFTER INSERT ON shares BEGIN
                INSERT INTO audit SELECT NEW.card_index, sum(core_milli), sum(memory_mib), count(*)
                FROM shares WHERE card_index = NEW.card_index;
            END;""")
    finally:
        con.close()


def test_many_concurrent_runs_never_overbook_a_card(db, tmp_path):
    """12 runs race for the 4 shares of 40 % that 2 cards hold. It decides on the claim, not on
    timing: the booked jobs hold their cards until the test releases them, so exactly 4 runs can
    book however slowly the others start (the old version let jobs end after 3 s, and a run that
    started later under load rightly got a freed share and failed the count); and the store
    records each card's total after every single booking, each checked against capacity."""
    assert qgpu_done("run", "--dbfile", str(db), *SIM, "--core", "10", "--memory", "1", "--", "true").returncode == 0
    _audit_every_booking(db)
    release = tmp_path / "release"
    hold = f"while [ ! -e {release} ]; do sleep 0.05; done"
    runs = [qgpu("run", "--dbfile", str(db), "--core", "40", "--memory", "1", "--", "sh", "-c", hold) for _ in range(12)]
    over = "SELECT card, core_milli, memory_mib, bookings FROM audit WHERE core_milli > 1000 OR memory_mib > 16384"
    try:
        wait_for(lambda: sum(p.poll() is not None for p in runs) >= 8 or rows(db, over), timeout=180,
                 what="8 runs turned away")
        assert rows(db, over) == []
        assert sorted(r for r in rows(db, "SELECT card_index, sum(core_milli), sum(memory_mib) FROM shares GROUP BY card_index")) == [
            (0, 800, 2048), (1, 800, 2048)]
    finally:
        release.touch()
    codes = [p.wait(timeout=120) for p in runs]
    assert sorted(codes) == [0] * 4 + [75] * 8
    assert sum("does not fit now" in p.stderr.read() for p in runs) == 8
    audit = rows(db, "SELECT card, core_milli, memory_mib, bookings FROM audit")
    assert len(audit) == 4 and all(core <= 1000 and memory <= 16384 for _, core, memory, _ in audit), audit
    assert rows(db, "SELECT count(*) FROM shares") == [(0,)]


def test_a_job_that_does_not_fit_now_fails_with_the_reason(db):
    first = qgpu("run", "--dbfile", str(db), *SIM, "--core", "200", "--", "sleep", "300")  # held until the SIGTERM below, however slow the machine
    wait_for(lambda: job_pgids(db))
    done = qgpu_done("run", "--dbfile", str(db), "--core", "30", "--memory", "5", "--", "true")
    assert done.returncode == 75
    assert "does not fit now" in done.stderr and "--wait" in done.stderr
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=30)


def test_more_memory_than_any_card_never_fits(db):
    done = qgpu_done("run", "--dbfile", str(db), *SIM, "--core", "30", "--memory", "20", "--", "true")
    assert done.returncode == 69
    assert done.stderr.startswith("qgpu run: job 'true' can never fit on this host: ")
    assert "(this host has card 0 T4 16384 MiB, card 1 T4 16384 MiB)" in done.stderr


def test_more_cards_than_the_host_has_never_fits(db):
    done = qgpu_done("run", "--dbfile", str(db), "--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G",
                     "--core", "200", "--", "true")
    assert done.returncode == 69 and "can never fit on this host" in done.stderr


def test_wait_does_not_wait_for_the_impossible(db):
    """Without the check this would wait for ever (no --wait-timeout): returning shows it did not."""
    done = qgpu_done("run", "--dbfile", str(db), "--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G",
                     "--core", "200", "--wait", "--", "true")
    assert done.returncode == 69 and "waiting for room" not in done.stderr


def test_an_h200_job_above_80_gib_needs_the_largest_card_flag(db):
    """The cluster's parser refuses more than 80 GiB per card unless told the largest card; the
    flag is the one every component takes, with the same bound."""
    h200 = ("--gpu-backend", "simulated", "--simulated-gpus", "1xH200-143771M")
    refused = qgpu_done("run", "--dbfile", str(db), *h200, "--core", "30", "--memory", "100", "--", "true")
    assert refused.returncode == 2
    assert "--memory 100: no card could ever hold it: the largest card has 80 GiB" in refused.stderr
    ran = qgpu_done("run", "--dbfile", str(db), *h200, "--largest-card-memory-mib", "143771",
                    "--core", "30", "--memory", "100", "--", "true")
    assert ran.returncode == 0, ran.stderr
    bad = qgpu_done("run", "--dbfile", str(db), *h200, "--largest-card-memory-mib", "0", "--memory", "100", "--", "true")
    assert (bad.returncode, bad.stderr) == (2, "qgpu run: --largest-card-memory-mib 0: must be within 1024..1048576 "
                                                "(MiB, a card of 1 GiB to 1 TiB)\n")


def test_bad_request_names_the_flag_value_and_rule(db):
    done = qgpu_done("run", "--dbfile", str(db), *SIM, "--core", "150", "--memory", "5", "--", "true")
    assert done.returncode == 2 and "--core 150" in done.stderr and "multiple of 100" in done.stderr
    online = qgpu_done("run", "--dbfile", str(db), "--class", "online", "--core", "30", "--memory", "5", "--", "true")
    assert online.returncode == 2 and "--core" in online.stderr and "memory only" in online.stderr


def test_without_recorded_cards_or_a_backend_the_error_says_what_to_do(db):
    done = qgpu_done("run", "--dbfile", str(db), "--core", "30", "--memory", "5", "--", "true")
    assert done.returncode == 2 and "qgpu manager serve --standalone" in done.stderr


def test_nvml_failure_is_a_clear_error_never_a_simulated_fallback(db, no_nvidia_driver):
    done = qgpu_done("run", "--dbfile", str(db), "--gpu-backend", "nvml", "--core", "30", "--memory", "5", "--", "true")
    assert done.returncode == 2 and "nvml" in done.stderr.lower()
    assert rows(db, "SELECT count(*) FROM cards") == [(0,)]


def test_wait_starts_the_job_once_room_is_released(db, tmp_path):
    """Ordered by events, not by a sleep: the first job holds the card until the second says it
    waits (a first job that ended on a timer could end before a slow second run even started)."""
    release = tmp_path / "release"
    first = qgpu("run", "--dbfile", str(db), "--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G",
                 "--core", "80", "--memory", "8", "--", "sh", "-c", f"while [ ! -e {release} ]; do sleep 0.05; done")
    wait_for(lambda: job_pgids(db))
    second = qgpu("run", "--dbfile", str(db), "--core", "80", "--memory", "8", "--wait", "--", "true")
    try:
        assert "waiting for room" in second.stderr.readline()
        assert second.poll() is None and rows(db, "SELECT count(*) FROM jobs") == [(1,)]
    finally:
        release.touch()
    assert first.wait(timeout=60) == 0
    assert second.wait(timeout=60) == 0 and "on card 0" in second.stderr.read()


def test_wait_timeout_gives_up_with_the_reason(db):
    first = qgpu("run", "--dbfile", str(db), "--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G",
                 "--core", "80", "--memory", "8", "--", "sleep", "300")  # until the SIGTERM below
    wait_for(lambda: job_pgids(db))
    done = qgpu_done("run", "--dbfile", str(db), "--core", "80", "--memory", "8", "--wait", "--wait-timeout", "0.5", "--", "true")
    assert done.returncode == 75 and "still does not fit" in done.stderr
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=30)


def test_ctrl_c_reaches_the_job_and_the_booking_is_released(db):
    p = qgpu("run", "--dbfile", str(db), *SIM, "--core", "30", "--memory", "5", "--", "sleep", "30")
    wait_for(lambda: job_pgids(db))
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=20) == 128 + signal.SIGINT
    assert rows(db, "SELECT count(*) FROM jobs") == [(0,)]


def ignoring_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_a_sigint_qgpu_was_started_ignoring_stays_ignored_by_the_job_too(db):
    # As a script's `qgpu run … &` starts it: SIGINT ignored. Neither qgpu nor the job reacts to it
    # (no forward, no SIGKILL on the second one); SIGTERM still ends the job and frees its booking.
    p = qgpu("run", "--dbfile", str(db), *SIM, "--core", "30", "--memory", "5", "--", "sleep", "30", preexec_fn=ignoring_sigint)
    pgid = wait_for(lambda: job_pgids(db).get("sleep"))
    ignored = int(next(line for line in Path(f"/proc/{pgid}/status").read_text().splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    assert ignored & (1 << (signal.SIGINT - 1)), "the job inherits the ignored SIGINT"
    for _ in range(2):  # one at a time: two pending SIGINTs would be taken as one
        p.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=1.5)
    assert proc_state(pgid) not in (None, "Z"), "the job still runs"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 128 + signal.SIGTERM
    assert rows(db, "SELECT count(*) FROM jobs") == [(0,)]


def test_a_killed_supervisor_takes_its_job_down_and_the_booking_is_reaped(db):
    p = qgpu("run", "--dbfile", str(db), *SIM, "--core", "30", "--memory", "5", "--", "sleep", "30")
    pgid = wait_for(lambda: job_pgids(db).get("sleep"))
    p.kill()
    p.wait(timeout=10)
    wait_for(lambda: proc_state(pgid) in (None, "Z"))
    store = Store(str(db))
    try:
        assert [c.workloads for c in host_status(store).cards] == [(), ()]  # the reader reaps first
    finally:
        store.close()
    assert rows(db, "SELECT count(*) FROM jobs") == [(0,)]


def test_qgpu_status_reads_the_standalone_database(db):
    p = qgpu("run", "--dbfile", str(db), *SIM, "--core", "30", "--memory", "5", "--name", "train", "--", "sleep", "30")
    wait_for(lambda: job_pgids(db))
    table = qgpu_done("status", "--standalone-db", str(db)).stdout
    assert "best-effort" in table and "T4" in table and "train(30%/5120MiB)" in table
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 128 + signal.SIGTERM


def _reaped_bookings(db) -> list[tuple]:
    """The bookings a reader sees after reaping the dead ones: (name, card, core milli)."""
    store = Store(str(db))
    try:
        return sorted((j.name, s.index, s.core_milli) for j in store.jobs() for s in j.shares)
    finally:
        store.close()


def test_a_child_that_outlives_a_killed_qgpu_run_keeps_the_booking(db, tmp_path):
    """`kill -9` of `qgpu run` takes the job's leader with it, not the leader's children: the
    booking must stay while they run, or a second job is put on the same share (120 %)."""
    child_pid = tmp_path / "child.pid"
    p = qgpu("run", "--dbfile", str(db), "--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G",
             "--core", "60", "--memory", "8", "--name", "trainer", "--",
             "sh", "-c", f'sleep 120 & echo $! > {child_pid}; wait')
    wait_for(lambda: job_pgids(db).get("trainer"))
    child = int(wait_for(lambda: child_pid.exists() and child_pid.read_text().strip()))
    p.kill()
    p.wait(timeout=10)
    leader = job_pgids(db)["trainer"]
    wait_for(lambda: proc_state(leader) in (None, "Z"), what="the job leader killed with its supervisor")
    assert proc_state(child) not in (None, "Z")

    assert _reaped_bookings(db) == [("trainer", 0, 600)]
    second = qgpu_done("run", "--dbfile", str(db), "--core", "60", "--memory", "8", "--name", "second", "--", "true")
    assert second.returncode == 75 and "does not fit now" in second.stderr
    assert _reaped_bookings(db) == [("trainer", 0, 600)]

    os.kill(child, signal.SIGKILL)
    wait_for(lambda: proc_state(child) in (None, "Z"), what="the child gone")
    wait_for(lambda: _reaped_bookings(db) == [], what="the booking reaped once no process of the job is left")
    assert qgpu_done("run", "--dbfile", str(db), "--core", "60", "--memory", "8", "--", "true").returncode == 0


def test_a_command_that_leaves_a_child_behind_keeps_its_booking_until_the_child_exits(db, tmp_path):
    """The same rule when the command itself ends normally but leaves a background process."""
    child_pid = tmp_path / "child.pid"
    done = qgpu_done("run", "--dbfile", str(db), "--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G",
                     "--core", "60", "--memory", "8", "--name", "daemonizer", "--",
                     "sh", "-c", f'sleep 120 > /dev/null 2>&1 & echo $! > {child_pid}')
    assert done.returncode == 0 and "still run" in done.stderr
    child = int(child_pid.read_text())
    try:
        assert _reaped_bookings(db) == [("daemonizer", 0, 600)]
        assert qgpu_done("run", "--dbfile", str(db), "--core", "60", "--memory", "8", "--", "true").returncode == 75
    finally:
        os.kill(child, signal.SIGKILL)
    wait_for(lambda: _reaped_bookings(db) == [], what="the booking reaped after the child")


def test_a_session_whose_leader_pid_was_reused_holds_nothing():
    """The job's leader is gone and its PID names a newer process: no process is the job's,
    even if the newer process leads a session of the same number."""
    from qgpu_runtime.standalone.store import JobRecord, ProcessInfo, job_processes

    job = JobRecord("j-1", "j", "normal", 300, 1024, (), "sleep", 0.0, 1, 1, pgid=4321, pgid_start=777)
    sessions = {4321: [ProcessInfo(4400, 4321, 800)]}
    assert job_processes(job, sessions, start_of={}.get) == [ProcessInfo(4400, 4321, 800)]
    assert job_processes(job, sessions, start_of={4321: 9000}.get) == []
    assert job_processes(job, {4321: [ProcessInfo(4400, 4321, 700)]}, start_of={}.get) == []


def test_a_signal_that_arrives_while_the_job_starts_reaches_it_once_it_runs():
    forward = _Forwarder()
    forward(signal.SIGTERM, None)  # qgpu run is signalled before the job exists
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        forward.started(child.pid)
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


def _children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                raw = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            if int(raw[raw.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(name))
    return found


def test_qgpu_run_killed_before_it_records_its_job_never_runs_the_command_and_the_booking_is_reaped(db, tmp_path):
    """The worst moment for `kill -9`: the job's process exists and its process group is not yet
    in the database. A trigger of this test's database makes `qgpu run`'s write of the process
    group take seconds; `qgpu run` is killed inside it. The command (which would leave a child
    behind that no reader could follow) never runs, and the booking goes with its supervisor."""
    assert qgpu_done("run", "--dbfile", str(db), *SIM, "--core", "10", "--memory", "1", "--", "true").returncode == 0
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("CREATE TABLE pause_rows (n INTEGER)")
    con.executemany("INSERT INTO pause_rows VALUES (?)", [(i,) for i in range(6000)])
    con.execute("CREATE TRIGGER pause_the_record BEFORE UPDATE OF pgid ON jobs "
                "BEGIN SELECT count(*) FROM pause_rows a, pause_rows b WHERE a.n * b.n = -1; END")  # ~3 s of work
    con.close()
    ran, survivor = tmp_path / "ran", tmp_path / "survivor.pid"
    p = qgpu("run", "--dbfile", str(db), "--core", "30", "--memory", "5", "--name", "unrecorded", "--",
             "sh", "-c", f"touch {ran}; sleep 313 & echo $! > {survivor}; wait")
    child = wait_for(lambda: _children(p.pid) and _children(p.pid)[0], what="qgpu run's child started")
    try:
        # the command, had it been started, has had time to run its first line
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=0.5)
        assert rows(db, "SELECT name, pgid FROM jobs") == [("unrecorded", None)], "still inside the paused write"
        p.kill()
        p.wait(timeout=10)
        wait_for(lambda: proc_state(child) in (None, "Z"), what="the waiting child gone with its supervisor")
        assert not ran.exists() and not survivor.exists(), "the command ran although its process group was never recorded"
        assert _reaped_bookings(db) == []
    finally:
        if survivor.exists():
            os.kill(int(survivor.read_text()), signal.SIGKILL)
