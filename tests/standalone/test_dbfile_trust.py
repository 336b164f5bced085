"""Who may write the standalone database, one manager per database, and jobs a killed manager held.

The manager signals the process groups the database names, as root on a shared host: a file
anyone else may write would let them stop or kill any process group (docs/standalone.md, "Who
may write the database")."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from qgpu_runtime.standalone.config import HostConfig
from qgpu_runtime.standalone.dbfile import ManagerLock, check_directory, check_file, claim, ensure_private, resolve
from qgpu_runtime.standalone.manager import StandaloneManager
from qgpu_runtime.standalone.store import JobRecord, JobShare, Store, StoreError, process_start_ticks

from .helpers import as_another_user, env, proc_state, qgpu_done, wait_for

SIM = ("--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G")


def _serve(db, *extra: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """A manager that is expected to refuse to start (a started one would run until the timeout)."""
    return qgpu_done("manager", "serve", "--standalone", "--dbfile", str(db), *SIM, *extra, timeout=timeout)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_manager_creates_its_database_and_companions_private(db, manager):
    manager()
    assert {name: _mode(f"{db}{name}") for name in ("", "-wal", "-shm", ".lock")} == {"": 0o600, "-wal": 0o600, "-shm": 0o600, ".lock": 0o600}


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602], ids=oct)
def test_the_manager_refuses_a_database_others_may_write(db, mode):
    db.touch()
    db.chmod(mode)
    done = _serve(db)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and f"--dbfile '{db}': mode {mode:04o}, owner uid {os.geteuid()}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_manager_refuses_a_companion_file_others_may_write(db):
    Store(str(db)).close()
    (db.parent / f"{db.name}-wal").write_bytes(b"")
    (db.parent / f"{db.name}-wal").chmod(0o666)
    done = _serve(db)
    assert done.returncode == 2 and f"--dbfile '{db}' ({db.name}-wal): mode 0666" in done.stderr, done.stderr


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775], ids=oct)
def test_the_manager_refuses_a_directory_others_may_write(tmp_path, mode):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    done = _serve(folder / "host.db")
    assert done.returncode == 2, done.stderr
    assert f"its directory '{folder}' has mode {mode:04o}" in done.stderr and "writable by no one else" in done.stderr, done.stderr
    assert not (folder / "host.db").exists()


def test_a_database_of_another_user_is_refused(tmp_path):
    db = tmp_path / "host.db"
    Store(str(db)).close()
    db.chmod(0o600)
    with pytest.raises(StoreError, match=rf"mode 0600, owner uid {os.geteuid()}: .* a file of uid 4242 that no one else may write"):
        check_file(str(db), str(db), uid=4242)


def test_a_directory_of_another_user_is_refused(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir()
    folder.chmod(0o755)
    if os.geteuid() == 0:  # root accepts its own folders: give this one away
        os.chown(folder, 4242, -1)
        owner, manager_uid, owners = 4242, 0, "root"
    else:
        owner, manager_uid = os.geteuid(), os.geteuid() + 1
        owners = f"uid {manager_uid} or root"
    with pytest.raises(StoreError, match=rf"has mode 0755, owner uid {owner}: .* owned by {owners} and writable by no one else"):
        check_directory(str(folder / "host.db"), manager_uid)


def test_qgpu_run_by_a_user_who_cannot_write_the_database_is_told_so(open_folder):
    db = os.path.join(open_folder, "host.db")
    ensure_private(db)
    os.chmod(db, 0o644)
    store = Store(db)
    store.close()
    done = subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "run", "--dbfile", db, "--core", "10", "--memory", "1", "--", "true"],
                          env=env(), capture_output=True, text=True, timeout=60, preexec_fn=as_another_user(open_folder))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"qgpu run: --dbfile {db!r}: not writable by uid ") and done.stderr.count("\n") == 1, done.stderr
    assert "only the manager's user may write it" in done.stderr


def test_a_second_manager_on_the_same_database_is_refused_naming_the_first(db, manager):
    first = manager()
    done = _serve(db)
    assert done.returncode == 2, done.stderr
    assert f"another manager (pid {first.pid}) holds '{db}.lock': one manager per database" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1


def test_the_lock_is_held_until_released_and_names_its_holder(tmp_path):
    db = str(tmp_path / "host.db")
    held = ManagerLock(db)
    with pytest.raises(StoreError, match=rf"another manager \(pid {os.getpid()}\) holds"):
        ManagerLock(db)
    held.release()
    ManagerLock(db).release()


def test_a_restarted_manager_resumes_the_jobs_a_killed_one_held(tmp_path):
    """kill -9 of a manager while it held a job (SIGSTOP, fixed-share) left it frozen for ever."""
    store = Store(str(tmp_path / "host.db"))
    config = HostConfig(node_name="h", gpu_backend="simulated", simulated_gpus="1xT4-16G")
    job = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        os.killpg(job.pid, signal.SIGSTOP)  # what the killed manager's duty cycle left behind
        wait_for(lambda: proc_state(job.pid) == "T", what="the job stopped")
        with store.transaction():
            store.insert_job(JobRecord("held-1", "held", "normal", 300, 1024, (JobShare(0, "GPU-x", 300, 1024),), "sleep 60",
                                       0.0, job.pid, process_start_ticks(job.pid) or 0))
            store.set_job_process("held-1", job.pid, process_start_ticks(job.pid) or 0)
        manager = StandaloneManager(store, config, CollectorRegistry())
        manager.start()
        try:
            wait_for(lambda: proc_state(job.pid) not in (None, "T"), what="the job resumed")
        finally:
            manager.close()
    finally:
        job.kill()
        job.wait()
        store.close()


# -- a --dbfile named through a link (the link's own folder may be anyone's) ---------------------


def _linked(tmp_path):
    """A private folder for the database and a sticky, world-writable one (a /tmp) holding a link to it."""
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir()
    shared.chmod(0o1777)
    link = shared / "qgpu.db"
    link.symlink_to(private / "host.db")
    return private / "host.db", link


def test_a_database_named_through_a_link_is_the_linked_file_from_the_first_check_on(tmp_path):
    """The manager resolves --dbfile once: the checks, the lock, the database and its MPS folder
    are the linked file's, in its private folder. Resolved at each use, a link in a folder anyone
    may write could be pointed at another file between the check and the open."""
    real, link = _linked(tmp_path)
    lock = claim(resolve(str(link)))
    try:
        store = Store(resolve(str(link)))
        store.close()
        assert lock.path == f"{real}.lock" and os.path.samefile(store.path, real) and store.path == str(real)
        assert sorted(p.name for p in link.parent.iterdir()) == ["qgpu.db"]  # nothing made next to the link
        assert {p.name for p in real.parent.iterdir()} >= {"host.db", "host.db.lock"}
    finally:
        lock.release()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a file of another user: root gives one away")
def test_qgpu_run_refuses_a_link_pointed_at_a_database_of_another_user(tmp_path):
    """A job's devices, MPS pipe and environment come from the database's rows: once the link is
    pointed at a file another user owns (theirs to write), qgpu run refuses it, naming the file."""
    real, link = _linked(tmp_path)
    (tmp_path / "other").mkdir(mode=0o755)
    theirs = tmp_path / "other" / "theirs.db"
    Store(str(theirs)).close()
    theirs.chmod(0o600)
    os.chown(theirs, 4242, -1)
    link.unlink()
    link.symlink_to(theirs)
    done = qgpu_done("run", "--dbfile", str(link), *SIM, "--core", "10", "--memory", "1", "--", "true")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"--dbfile '{theirs}': mode 0600, owner uid 4242" in done.stderr, done.stderr
    assert not real.exists()


def test_a_database_qgpu_run_creates_is_private(db):
    done = qgpu_done("run", "--dbfile", str(db), *SIM, "--core", "10", "--memory", "1", "--", "true")
    assert done.returncode == 0, done.stderr
    assert _mode(db) == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o775], ids=oct)
def test_a_folder_above_the_database_that_others_may_write_is_refused(tmp_path, mode):
    """Whoever may write a folder above the database's can rename the database's folder away and
    put their own in its place; a sticky one (/tmp) lets only the entry's owner rename it."""
    above, folder = tmp_path / "open", tmp_path / "open" / "qgpu"
    folder.mkdir(parents=True, mode=0o700)
    above.chmod(mode)
    with pytest.raises(StoreError, match=rf"'{above}', above its directory, has mode {mode:04o}.* or sticky"):
        check_directory(str(folder / "host.db"), os.geteuid())
    above.chmod(0o1777)
    assert check_directory(str(folder / "host.db"), os.geteuid()) == str(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a folder another user cannot enter: root runs the command as nobody")
def test_a_database_in_a_folder_the_user_cannot_enter_is_one_line_not_a_traceback(tmp_path, open_folder):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    done = subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "run", "--dbfile", str(private / "host.db"), "--core", "10",
                           "--memory", "1", "--", "true"], env=env(), capture_output=True, text=True, timeout=60,
                          preexec_fn=as_another_user(open_folder))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Permission denied" in done.stderr, done.stderr
