"""The thin edges: signals on real processes, and NVML attribution through a stand-in NVML module
(NVML is a boundary we do not own and cannot run without a driver)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from qgpu_runtime.gpu.nvml_processes import ProcessSampler
from qgpu_runtime.isolation.engine import CardQuota, Workload
from qgpu_runtime.isolation.mps import client_env, pinned_limits_supported
from qgpu_runtime.isolation.nvml_sampler import NvmlSampler
from qgpu_runtime.isolation.signals import SignalActuator
from qgpu_runtime.model import AppClass


def _state(pid: int) -> str:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2]


def _pgid(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2:].split()[2])


def _wait_state(pid: int, want: str, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _state(pid) == want:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never reached state {want}, is {_state(pid)}")


@pytest.fixture
def group():
    # a shell with a child, in its own process group: both must be held together
    # "ready" once the child is forked (it is in the group from then on): no fixed sleep, which a
    # loaded machine outruns
    p = subprocess.Popen(["sh", "-c", "sleep 30 & echo ready; wait"], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    yield p
    if p.poll() is None:
        p.kill()
        p.wait()


def test_hold_and_resume_act_on_the_whole_process_group(group):
    act = SignalActuator(lambda key: [group.pid])
    child = next(int(d.name) for d in Path("/proc").iterdir()
                 if d.name.isdigit() and int(d.name) != group.pid and _pgid(int(d.name)) == group.pid)
    act.hold("job")
    _wait_state(group.pid, "T")
    _wait_state(child, "T")
    act.resume("job")
    _wait_state(child, "S")


def test_stop_terminates_a_held_job_and_kills_it_after_the_grace_period():
    # "ready" once SIGTERM is ignored: a SIGTERM sent earlier would end it before the trap
    p = subprocess.Popen(["sh", "-c", "trap '' TERM; echo ready; sleep 30"], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    clock = {"now": 0.0}
    act = SignalActuator(lambda key: [p.pid], grace_s=5.0, clock=lambda: clock["now"])
    act.hold("job")
    act.stop("job", "over quota")
    time.sleep(0.3)
    assert p.poll() is None  # it ignores SIGTERM
    clock["now"] = 6.0
    act.reap()
    assert p.wait(timeout=5) == -signal.SIGKILL


def test_kill_ends_a_held_job_that_ignores_sigterm_at_once_and_cancels_its_pending_grace_kill():
    p = subprocess.Popen(["sh", "-c", "trap '' TERM; echo ready; sleep 30"], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    sent: list[int] = []

    def killpg(pgid: int, sig: int) -> None:
        sent.append(sig)
        os.killpg(pgid, sig)
    act = SignalActuator(lambda key: [p.pid], grace_s=5.0, clock=lambda: 0.0, killpg=killpg)
    act.hold("job")
    act.stop("job", "over quota")
    act.kill("job", "over quota again")  # no grace: SIGCONT (it is held), then SIGKILL
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert sent[-2:] == [signal.SIGCONT, signal.SIGKILL]
    sent.clear()
    act.reap()
    assert sent == []  # the grace kill the stop scheduled went with it


def test_signals_to_a_gone_job_are_harmless():
    p = subprocess.Popen(["true"], start_new_session=True)
    p.wait()
    act = SignalActuator(lambda key: [p.pid])
    act.hold("job")
    act.resume("job")


@dataclass
class _Util:
    pid: int
    timeStamp: int
    smUtil: int


@dataclass
class _Proc:
    pid: int
    usedGpuMemory: int | None


class _FakeNvml:
    """Answers the four NVML calls the sampler makes, with scripted values."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):
        pass

    def __init__(self):
        self.util: list[_Util] = []
        self.procs: list[_Proc] = []

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetProcessUtilization(self, handle, last_seen):
        fresh = [u for u in self.util if u.timeStamp > last_seen]
        if not fresh:
            raise self.NVMLError_NotFound()
        return fresh

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return self.procs


def test_nvml_samples_are_summed_per_workload_and_foreign_processes_ignored():
    nvml = _FakeNvml()
    owners = {101: "a", 102: "a", 201: "b"}
    sampler = NvmlSampler(ProcessSampler(nvml, [0]).reader(), owners.get)
    nvml.procs = [_Proc(101, 1 << 30), _Proc(102, 512 << 20), _Proc(201, None), _Proc(999, 4 << 30)]
    nvml.util = [_Util(101, 200_000, 30), _Util(102, 200_000, 20), _Util(201, 200_000, 10), _Util(999, 200_000, 40)]
    work = [Workload("a", AppClass.NORMAL, (CardQuota(0, 500, 2048),)), Workload("b", AppClass.NORMAL, (CardQuota(0, 500, 2048),))]
    got = sampler.sample(work, 0.05, frozenset())[0]
    assert set(got) == {"a", "b"}  # pid 999 belongs to nobody we manage
    assert got["a"].memory_mib == 1536 and got["b"].memory_mib == 0
    # the first sample covers the time since each pid appeared (one tick here): 30 % + 20 % of the card
    assert got["a"].used_milli == pytest.approx(500)
    # no new sample next tick: charged at the learned running rate
    assert sampler.sample(work, 0.05, frozenset())[0]["a"].used_milli == pytest.approx(500)
    # held: nothing estimated
    assert sampler.sample(work, 0.05, frozenset({"a"}))[0]["a"].used_milli == 0


def test_mps_client_settings():
    env = client_env("/pipe", "/log", 300, 5120, pinned_limits=True)
    assert env == {"CUDA_MPS_PIPE_DIRECTORY": "/pipe", "CUDA_MPS_LOG_DIRECTORY": "/log",
                   "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=5120M"}
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in client_env("/p", "/l", 300, 5120, pinned_limits=False)
    assert (pinned_limits_supported(11040), pinned_limits_supported(11050), pinned_limits_supported(13000)) == (False, True, True)


class _Recorder:
    """A killpg that records instead of signalling: these groups are made up."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []

    def __call__(self, pgid: int, sig: int) -> None:
        self.sent.append((pgid, sig))


@pytest.mark.parametrize("pgid", [0, 1, -1, 4242], ids=["zero", "init", "negative", "own"])
def test_the_actuator_never_signals_group_zero_init_or_its_own(pgid):
    kill = _Recorder()
    act = SignalActuator(lambda key: [pgid], killpg=kill, own_pgid=4242, clock=lambda: 10.0, grace_s=0.0)
    act.hold("job")
    act.stop("job", "over quota")
    act.reap()
    assert kill.sent == []


def test_the_grace_kill_is_not_sent_to_a_group_that_is_no_longer_the_workloads():
    kill = _Recorder()
    groups = {"job": [777]}
    clock = {"now": 0.0}
    act = SignalActuator(lambda key: groups.get(key, []), killpg=kill, own_pgid=1000, clock=lambda: clock["now"])
    act.stop("job", "over quota")
    groups["job"] = []  # it ended after SIGTERM; 777 may now be someone else's group
    clock["now"] = 6.0
    act.reap()
    assert signal.SIGKILL not in [s for _, s in kill.sent]


def test_the_grace_kill_reaches_a_process_that_left_its_group_on_sigterm():
    kill = _Recorder()
    groups = {"job": [777]}
    clock = {"now": 0.0}
    act = SignalActuator(lambda key: groups.get(key, []), killpg=kill, own_pgid=1000, clock=lambda: clock["now"])
    act.stop("job", "over quota")
    groups["job"] = [888]  # its GPU process called setsid() in its SIGTERM handler: a group of its own
    clock["now"] = 6.0
    act.reap()
    assert [(g, s) for g, s in kill.sent if s == signal.SIGKILL] == [(888, signal.SIGKILL)]
    clock["now"] = 20.0
    act.reap()  # one kill per stop: nothing is due any more
    assert [s for _, s in kill.sent].count(signal.SIGKILL) == 1


def test_a_second_stop_does_not_put_the_grace_kill_off():
    kill = _Recorder()
    clock = {"now": 0.0}
    act = SignalActuator(lambda key: [777], killpg=kill, own_pgid=1000, clock=lambda: clock["now"], grace_s=5.0)
    act.stop("job", "over quota")
    clock["now"] = 4.0
    act.stop("job", "still over quota")
    clock["now"] = 5.0
    act.reap()
    assert (777, signal.SIGKILL) in kill.sent


def test_a_workload_being_stopped_does_not_read_as_resumed_behind_the_engines_back():
    """The stop continues a held workload (SIGCONT, then SIGTERM) so it can handle SIGTERM in its
    grace; read as running, the engine held it again at the next tick and it was frozen until the
    SIGKILL (review, 2026-12-01)."""
    act = SignalActuator(lambda key: [], killpg=lambda pgid, sig: None, clock=lambda: 0.0, running=lambda key: True)
    assert act.running("job")  # type: ignore[attr-defined]
    act.stop("job", "over its memory quota")
    assert not act.running("job")  # type: ignore[attr-defined]
    assert act.running("other")  # type: ignore[attr-defined]
