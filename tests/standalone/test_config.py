"""Host settings, simulated inventories, job environments and the booking rules (in process)."""

from __future__ import annotations

import pytest

from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.model import AppClass
from qgpu_runtime.placement import Unschedulable
from qgpu_runtime.standalone.booking import JobRequestError, JobSpec, job_request, try_book
from qgpu_runtime.standalone.config import HostConfig, load_config, simulated_cards
from qgpu_runtime.standalone.store import JobRecord, JobShare, Store
from qgpu_runtime.standalone.supervisor import exit_status, job_environment


def test_file_settings_are_overridden_by_flags(tmp_path):
    f = tmp_path / "host.yaml"
    f.write_text("policy: fs\nmps: auto\ntick_s: 0.1\n")
    config = load_config(str(f), {"policy": "burst-share", "tick_s": None, "node_name": "h1"})
    assert (config.policy, config.mps, config.tick_s, config.node_name) == (Policy.BURST_SHARE, "auto", 0.1, "h1")


def test_unknown_setting_in_the_file_is_named(tmp_path):
    f = tmp_path / "host.yaml"
    f.write_text("polcy: fs\n")
    with pytest.raises(ValueError, match="unknown setting.*polcy"):
        load_config(str(f), {})


def test_simulated_cards_only_when_asked_for():
    with pytest.raises(ValueError, match="only used with gpu_backend simulated"):
        HostConfig("h", simulated_gpus="1xT4-16G")
    with pytest.raises(ValueError, match="needs a spec"):
        HostConfig("h", gpu_backend="simulated")


def test_simulated_spec_gives_stable_uuids_and_memory():
    cards = simulated_cards("2xT4-16G,1xA100-80G", "host-a")
    assert [(c.index, c.model, c.memory_mib) for c in cards] == [(0, "T4", 16384), (1, "T4", 16384), (2, "A100", 81920)]
    assert cards == simulated_cards("2xT4-16G,1xA100-80G", "host-a")
    assert cards[0].uuid != simulated_cards("2xT4-16G", "host-b")[0].uuid
    with pytest.raises(ValueError, match="not a card spec"):
        simulated_cards("two T4s", "h")


def test_offline_core_becomes_the_greedy_share_and_online_reserves_memory_only():
    offline = job_request(JobSpec("b", 40, 2, AppClass.OFFLINE))
    online = job_request(JobSpec("w", None, 2, AppClass.ONLINE))
    assert (offline.klass, offline.containers[0].core_milli) == (AppClass.OFFLINE, 400)
    assert (online.containers[0].core_milli, online.containers[0].memory_mib) == (0, 2048)
    with pytest.raises(JobRequestError, match="--memory"):
        job_request(JobSpec("x", 30, None))


def _job(shares, exclusive=False, core=300, memory=5120):
    return JobRecord("j-1", "j", "normal", core, memory, tuple(shares), "cmd", 0.0, 1, 1, exclusive=exclusive)


def test_environment_names_the_cards_by_uuid_and_the_quota():
    env = job_environment({"PATH": "/bin"}, _job([JobShare(1, "GPU-x", 300, 5120)]), Policy.BEST_EFFORT, None)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-x" and env["QGPU_CORE_MILLI"] == "300" and env["PATH"] == "/bin"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in env


def test_mps_caps_threads_only_under_fixed_share_and_pins_memory_when_supported():
    mps = {"pipe_dir": "/p", "log_dir": "/l", "pinned": "1"}
    job = _job([JobShare(0, "GPU-x", 300, 5120)])
    fixed = job_environment({}, job, Policy.FIXED_SHARE, mps)
    burst = job_environment({}, job, Policy.BURST_SHARE, mps)
    assert fixed["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30" and fixed["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=5120M"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in burst and burst["CUDA_MPS_PIPE_DIRECTORY"] == "/p"
    whole = job_environment({}, _job([JobShare(0, "GPU-x", 1000, 16384)], exclusive=True), Policy.FIXED_SHARE, mps)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in whole


def test_exit_status_reads_like_a_shell():
    assert (exit_status(3), exit_status(-15)) == (3, 143)


def test_booking_respects_live_jobs_and_reaps_dead_ones(tmp_path):
    import os

    from qgpu_runtime.standalone.store import process_start_ticks

    store = Store(str(tmp_path / "s.db"))
    store.set_cards(simulated_cards("1xT4-16G", "h"))
    config = HostConfig("h", gpu_backend="simulated", simulated_gpus="1xT4-16G")
    me, start = os.getpid(), process_start_ticks(os.getpid())
    try_book(store, config, JobSpec("a", 60, 4), "a-1", "x", me, start, 1.0)
    with pytest.raises(Unschedulable):
        try_book(store, config, JobSpec("b", 60, 4), "b-1", "x", me, start, 2.0)
    # a booking whose supervisor is gone (pid 1's start time never matches ours) is reaped
    try_book(store, config, JobSpec("c", 30, 4), "c-1", "x", 1, -1, 3.0)
    assert [j.id for j in store.jobs()] == ["a-1"]
    try_book(store, config, JobSpec("d", 40, 4), "d-1", "x", me, start, 4.0)
    assert sorted(j.id for j in store.jobs()) == ["a-1", "d-1"]


def _stat(pid: int, comm: str, state: str, session: int, start: int) -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    # cutime cstime priority nice threads itrealvalue starttime ...
    fields = [state, "1", str(session), str(session)] + ["0"] * 15 + [str(start), "0", "0"]
    return f"{pid} ({comm}) " + " ".join(fields) + "\n"


def test_sessions_are_read_from_proc_skipping_exited_and_odd_entries(tmp_path):
    from qgpu_runtime.standalone.store import ProcessInfo, session_members

    for pid, comm, state, session, start in [(10, "sh", "S", 10, 500), (11, "a) (b", "R", 10, 510),
                                             (12, "gone", "Z", 10, 520), (20, "other", "S", 20, 100)]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat(pid, comm, state, session, start))
    (tmp_path / "self").mkdir()
    (tmp_path / "30").mkdir()  # vanished between listing and reading
    assert session_members(str(tmp_path)) == {
        10: [ProcessInfo(10, 10, 500), ProcessInfo(11, 10, 510)], 20: [ProcessInfo(20, 20, 100)]}


def test_a_process_whose_main_thread_exited_is_alive_and_an_unreadable_stat_is_skipped(tmp_path):
    """``pthread_exit`` in main leaves state Z with other threads running: before, the job's group
    read as gone (never held or stopped); a stat line without ``)`` or cut short raised."""
    from qgpu_runtime.standalone.store import ProcessInfo, session_members

    def stat(pid, state, threads, start):
        fields = [state, "1", "10", "10"] + ["0"] * 13 + [str(threads), "0", str(start), "0", "0"]
        return f"{pid} (w\xff) " + " ".join(fields) + "\n"

    for pid, text in [(10, stat(10, "Z", 3, 500)), (11, stat(11, "Z", 1, 510)), (12, "12 no parenthesis S 1 10 10\n"),
                      (13, "13 (cut) S 1 10\n")]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_bytes(text.encode("latin-1"))
    assert session_members(str(tmp_path)) == {10: [ProcessInfo(10, 10, 500)]}
