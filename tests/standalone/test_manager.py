"""`qgpu manager serve --standalone`: the node policy enforced on real job processes (simulated cards)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from qgpu_runtime.standalone.manager import job_groups
from qgpu_runtime.standalone.store import JobRecord, process_start_ticks

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


def test_standalone_refuses_the_node_managers_options_instead_of_ignoring_them(db):
    done = qgpu_done("manager", "serve", "--standalone", "--dbfile", str(db), "--gpu-backend", "simulated",
                     "--simulated-gpus", "1xT4-16G", "--metrics-address", "127.0.0.1", "--metrics-port", "9999")
    assert done.returncode == 2, done.stderr
    assert "--metrics-address, --metrics-port belong(s) to the cluster node manager" in done.stderr
    assert not db.exists()  # refused before anything started


@pytest.mark.parametrize("given", [["--metrics-port", "5678"], ["--metrics-address", "0.0.0.0"]])
def test_standalone_refuses_a_node_option_even_at_its_default_value(db, given):
    """Given is given: an option of the other manager is refused even when its value is the default."""
    done = qgpu_done("manager", "serve", "--standalone", "--dbfile", str(db), "--gpu-backend", "simulated",
                     "--simulated-gpus", "1xT4-16G", *given)
    assert done.returncode == 2, done.stderr
    assert f"{given[0]} belong(s) to the cluster node manager" in done.stderr
    assert not db.exists()


def test_the_node_manager_refuses_the_standalone_options(db):
    done = qgpu_done("manager", "serve", "--nodename", "n1", "--dbfile", str(db), "--policy", "fs")
    assert done.returncode == 2 and "--policy belong(s) to the standalone manager" in done.stderr


def test_the_node_manager_refuses_a_standalone_option_at_its_default_value(db):
    done = qgpu_done("manager", "serve", "--nodename", "n1", "--dbfile", str(db), "--standalone-metrics-port", "0")
    assert done.returncode == 2 and "--standalone-metrics-port belong(s) to the standalone manager" in done.stderr


def test_standalone_takes_the_node_spelling_of_name_and_policy(db, manager):
    manager("fixed-share", "1xT4-16G", "--isolation-policy", "fs", "--nodename", "host-a")  # agreeing spellings
    assert dict(rows(db, "SELECT key, value FROM meta WHERE key IN ('node', 'policy')")) == {
        "node": "host-a", "policy": "fixed-share"}


def test_standalone_refuses_disagreeing_policies(db):
    done = qgpu_done("manager", "serve", "--standalone", "--dbfile", str(db), "--gpu-backend", "simulated",
                     "--simulated-gpus", "1xT4-16G", "--policy", "be", "--isolation-policy", "fs")
    assert done.returncode == 2 and "--policy 'be' and --isolation-policy 'fs' disagree" in done.stderr


def _job(pgid: int, pgid_start: int) -> JobRecord:
    return JobRecord("j-1", "j", "normal", 300, 1024, (), "sleep", 0.0, 1, 1, pgid=pgid, pgid_start=pgid_start)


def test_a_job_group_is_signalled_while_its_leader_is_the_recorded_process():
    assert job_groups(_job(4321, 777), start_of={4321: 777}.get) == [4321]


def test_a_job_group_whose_leader_pid_was_reused_is_not_signalled():
    """The job ended and PID 4321 went to a process started later: it is not the job's."""
    assert job_groups(_job(4321, 777), start_of={4321: 9000}.get) == []


def test_a_job_group_whose_leader_is_gone_is_still_the_jobs():
    """The number stays reserved while the job's children live in that group."""
    assert job_groups(_job(4321, 777), start_of={}.get) == [4321]


def test_a_real_process_is_recognised_by_its_start_time():
    p = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        start = process_start_ticks(p.pid)
        assert job_groups(_job(p.pid, start)) == [p.pid]
        assert job_groups(_job(p.pid, start - 1)) == []
    finally:
        p.kill()
        p.wait()


def test_children_left_by_a_killed_qgpu_run_stay_under_the_policy(db, manager, tmp_path):
    """After `kill -9` of `qgpu run` its job's surviving child keeps the booking, so the manager
    keeps enforcing the share on it; stopping the manager resumes it."""
    mgr = manager("fixed-share")
    child_pid = tmp_path / "child.pid"
    job = qgpu("run", "--dbfile", str(db), "--core", "30", "--memory", "2", "--name", "orphan", "--",
               "sh", "-c", f"sleep 60 & echo $! > {child_pid}; wait")
    wait_for(lambda: job_pgids(db).get("orphan"))
    child = int(wait_for(lambda: child_pid.exists() and child_pid.read_text().strip()))
    job.kill()
    job.wait(timeout=10)
    try:
        time.sleep(1.5)  # past the manager's once-a-second reaping
        assert rows(db, "SELECT name FROM jobs") == [("orphan",)]
        assert 0.5 < _stopped_fraction(child) < 0.9  # still duty-cycled to about its 30 %
        assert stop(mgr) == 0
        assert _stopped_fraction(child, 0.5) == 0.0
    finally:
        os.kill(child, signal.SIGKILL)


def test_qgpu_status_shows_what_each_job_uses_beside_what_it_booked(db, manager, tmp_path):
    """The manager writes the jobs' sampled use to the store every second; `qgpu status` shows it
    beside each booking and per card, and stops showing it once it is stale."""
    import json

    from qgpu_runtime.status_cmd import USAGE_STALE_S, read_store_status

    manager("best-effort", "2xT4-16G")
    job = qgpu("run", "--dbfile", str(db), "--core", "50", "--memory", "4", "--name", "web", "--", "sleep", "60")
    wait_for(lambda: job_pgids(db).get("web"))
    job_id = rows(db, "SELECT id FROM jobs WHERE name='web'")[0][0]
    write_json(tmp_path / "usage.json", {job_id: {"demand_milli": 300, "memory_mib": 1500}})

    def shown():
        out = qgpu_done("status", "--standalone-db", str(db), "--json")
        assert out.returncode == 0, out.stderr
        (node,) = json.loads(out.stdout)["nodes"]
        (card,) = [c for c in node["cards"] if c["workloads"]]
        return node, card
    wait_for(lambda: shown()[1]["workloads"][0]["used_memory_mib"] == 1500, timeout=10)
    time.sleep(1.5)  # a whole write interval at the new demand
    node, card = shown()
    (web,) = card["workloads"]
    assert node["usage_error"] == "" and web["name"] == "web" and web["core_milli"] == 500
    assert 25 <= web["used_core_pct"] <= 35, web  # best-effort: the job runs at its own demand, 30 %
    assert (card["memory_used_mib"], 25 <= card["util_pct"] <= 35) == (1500, True), card
    idle = [c for c in node["cards"] if not c["workloads"]]
    assert [(c["util_pct"], c["memory_used_mib"]) for c in idle] == [(0, 0)]
    table = qgpu_done("status", "--standalone-db", str(db)).stdout
    assert "web(50%/4096MiB,used " in table and "%/1500MiB)" in table, table
    stop(job)

    # with nothing running the manager still samples: every card at 0, and fresh (not "no sample")
    def idle_sample() -> list[tuple] | None:
        got = rows(db, "SELECT workload_id, sm_pct, memory_mib, sampled FROM usage")
        return got if got and all(r[0] == "" for r in got) else None
    idle = wait_for(idle_sample, timeout=10)
    assert sorted((r[1], r[2]) for r in idle) == [(0, 0), (0, 0)]
    now = read_store_status(db)
    assert now.usage_error == "" and [(c.util_pct, c.memory_used_mib) for c in now.cards] == [(0, 0), (0, 0)]

    sampled = rows(db, "SELECT max(sampled) FROM usage")[0][0]
    late = read_store_status(db, now=sampled + USAGE_STALE_S + 5)
    assert all(c.util_pct is None and all(w.used_memory_mib is None for w in c.workloads) for c in late.cards)
    assert "last sample is 35 s old" in late.usage_error
