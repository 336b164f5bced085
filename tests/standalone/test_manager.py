"""`qgpu manager serve --standalone`: the node policy enforced on real job processes (simulated cards)."""

from __future__ import annotations

import signal
import time

from .helpers import job_pgids, proc_state, qgpu, qgpu_done, rows, stop, wait_for, write_json


def _stopped_fraction(pid: int, seconds: float = 2.0) -> float:
    seen = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen.append(proc_state(pid) == "T")
        time.sleep(0.01)
    return sum(seen) / len(seen)


def test_fixed_share_duty_cycles_a_busy_job_to_about_its_share(db, manager):
    manager("fixed-share")
    job = qgpu("run", "--dbfile", str(db), "--core", "30", "--memory", "2", "--name", "capped", "--", "sleep", "30")
    pgid = wait_for(lambda: job_pgids(db).get("capped"))
    time.sleep(0.5)
    # the simulated card says it is busy whenever it runs: it should be suspended ~70 % of the time
    assert 0.5 < _stopped_fraction(pgid) < 0.9
    stop(job)


def test_best_effort_never_suspends(db, manager):
    manager("best-effort")
    job = qgpu("run", "--dbfile", str(db), "--core", "30", "--memory", "2", "--name", "free", "--", "sleep", "30")
    pgid = wait_for(lambda: job_pgids(db).get("free"))
    assert _stopped_fraction(pgid, 1.0) == 0.0
    stop(job)


def test_offline_job_is_held_while_an_online_job_is_busy_and_resumes_after(db, manager, tmp_path):
    manager("best-effort")
    batch = qgpu("run", "--dbfile", str(db), "--class", "offline", "--core", "50", "--memory", "2", "--name", "batch", "--", "sleep", "60")
    batch_pgid = wait_for(lambda: job_pgids(db).get("batch"))
    assert _stopped_fraction(batch_pgid, 0.5) == 0.0
    web = qgpu("run", "--dbfile", str(db), "--class", "online", "--memory", "2", "--name", "web", "--", "sleep", "60")
    wait_for(lambda: job_pgids(db).get("web"))
    wait_for(lambda: proc_state(batch_pgid) == "T", timeout=2.0)
    assert _stopped_fraction(batch_pgid, 0.5) == 1.0
    web_id = rows(db, "SELECT id FROM jobs WHERE name='web'")[0][0]
    write_json(tmp_path / "usage.json", {web_id: {"demand_milli": 0}})
    wait_for(lambda: proc_state(batch_pgid) == "S", timeout=5.0)
    stop(web)
    stop(batch)


def test_memory_over_quota_stops_the_job_and_says_why_everywhere(db, manager, tmp_path):
    mgr = manager("best-effort")
    job = qgpu("run", "--dbfile", str(db), "--core", "30", "--memory", "4", "--name", "greedy", "--", "sleep", "60")
    wait_for(lambda: job_pgids(db).get("greedy"))
    job_id = rows(db, "SELECT id FROM jobs WHERE name='greedy'")[0][0]
    write_json(tmp_path / "usage.json", {job_id: {"memory_mib": 6000}})
    assert job.wait(timeout=20) == 128 + signal.SIGTERM
    err = job.stderr.read()
    assert "GPUMemoryQuotaExceeded" in err and "6000 MiB" in err and "4096 MiB" in err   # what the user sees
    assert rows(db, "SELECT job, reason FROM events") == [(job_id, "GPUMemoryQuotaExceeded")]  # event record
    stop(mgr)
    assert "stopped by the qgpu memory watchdog" in mgr.stderr.read()  # log line


def test_stopping_the_manager_resumes_held_jobs(db, manager):
    mgr = manager("fixed-share")
    job = qgpu("run", "--dbfile", str(db), "--core", "10", "--memory", "2", "--name", "tiny", "--", "sleep", "30")
    pgid = wait_for(lambda: job_pgids(db).get("tiny"))
    wait_for(lambda: proc_state(pgid) == "T")
    assert stop(mgr) == 0
    assert _stopped_fraction(pgid, 0.5) == 0.0
    stop(job)


def test_manager_records_the_policy_every_run_then_uses(db, manager):
    manager("bs", "2xT4-16G")
    assert rows(db, "SELECT value FROM meta WHERE key='policy'") == [("burst-share",)]
    done = qgpu_done("run", "--dbfile", str(db), "--core", "30", "--memory", "2", "--", "true")
    assert "policy burst-share" in done.stderr and done.returncode == 0


def test_manager_refuses_nvml_when_there_is_no_driver(db, no_nvidia_driver):
    done = qgpu_done("manager", "serve", "--standalone", "--dbfile", str(db), "--gpu-backend", "nvml")
    assert done.returncode == 2 and "nvmlInit" in done.stderr


def test_manager_without_standalone_is_the_cluster_node_manager(db):
    done = qgpu_done("manager", "serve", "--dbfile", str(db))
    assert done.returncode == 2 and "--nodename is required" in done.stderr
