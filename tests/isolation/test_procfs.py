"""Reading a proc root: the command name in ``stat`` is bytes a process chose for itself, so
nothing a process can name itself may make a read raise (one raise stopped the isolation loop for
every tenant of the node)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from qgpu_runtime.isolation.procfs import ProcFS, ProcStat


def _write_stat(root: Path, pid: int, raw: bytes, cgroup: bytes = b"0::/\n") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_bytes(raw)
    (d / "cgroup").write_bytes(cgroup)


def _stat_line(pid: int, comm: bytes, pgid: int, start: int, state: bytes = b"S", flags: int = 0x400100, threads: int = 1) -> bytes:
    return (b"%d (%s) %s 1 %d %d 0 -1 %d " % (pid, comm, state, pgid, pgid, flags) + b"0 " * 10
            + b"%d 0 %d 0 0\n" % (threads, start))


@pytest.mark.parametrize("comm", [
    b"\xff\xfeevil",                                  # prctl(PR_SET_NAME, b"\xff\xfeevil")
    "ab训练脚本程序".encode()[:15],                    # a UTF-8 file name the kernel cut mid-character
    b"a) S 1 9 9 (b",                                 # a name that mimics the fields after it
], ids=["not-utf8", "cut-utf8", "parentheses"])
def test_any_command_name_reads_the_fields_after_the_last_parenthesis(tmp_path, comm):
    _write_stat(tmp_path, 4242, _stat_line(4242, comm, pgid=77, start=5150))
    proc = ProcFS(tmp_path)
    assert proc.stat(4242) == ProcStat(4242, 77, 5150)
    assert proc.group_members(77) == [4242]
    assert not proc.ended(4242)


def test_a_cgroup_that_is_not_utf8_reads_without_raising(tmp_path):
    _write_stat(tmp_path, 10, _stat_line(10, b"x", 10, 1), cgroup=b"0::/user.slice/\xff\xfe.scope\n")
    assert ProcFS(tmp_path).cgroup(10) == "0::/user.slice/\udcff\udcfe.scope\n"


def test_a_process_whose_stat_cannot_be_parsed_is_unknown_and_may_be_in_any_group(tmp_path):
    _write_stat(tmp_path, 10, _stat_line(10, b"leader", 10, 1))
    _write_stat(tmp_path, 11, b"11 garbled")
    proc = ProcFS(tmp_path)
    assert proc.stat(11) is None            # nothing is known of it: it is not attributed
    assert not proc.ended(11)               # ... but it has not been shown to have ended
    assert proc.group_members(10) == [10, 11]  # so a group scan cannot vouch that it is not a member


def test_a_process_that_ended_or_is_a_zombie_has_ended(tmp_path):
    _write_stat(tmp_path, 12, _stat_line(12, b"z", 12, 1, state=b"Z"))
    proc = ProcFS(tmp_path)
    assert proc.ended(12) and proc.ended(13)
    assert proc.stat(12) is None and proc.stat(13) is None and proc.cgroup(13) is None
    assert proc.group_members(12) == []


def test_a_process_whose_main_thread_exited_while_its_other_threads_run_is_alive(tmp_path):
    # pthread_exit() in main(): the thread group's leader reads "Z", the work goes on in a thread
    _write_stat(tmp_path, 14, _stat_line(14, b"trainer", 14, 5150, state=b"Z", flags=0x40800C, threads=2))
    proc = ProcFS(tmp_path)
    assert proc.stat(14) == ProcStat(14, 14, 5150)
    assert not proc.ended(14) and proc.group_members(14) == [14]


def test_a_leader_that_exited_reads_the_cgroup_its_threads_run_in(tmp_path):
    """cgroup v1: the exited leader's own file names the root while its threads run on in the
    container; before, the process was attributed to no pod (unmanaged: no share, no memory cap),
    and a group holding it was never signalled."""
    container = b"11:pids:/kubepods/podabc/cid1\n8:memory:/kubepods/podabc/cid1\n"
    _write_stat(tmp_path, 14, _stat_line(14, b"trainer", 14, 5150, state=b"Z", threads=2), cgroup=b"11:pids:/\n8:memory:/\n")
    for tid, text in ((14, b"11:pids:/\n8:memory:/\n"), (15, container)):
        (tmp_path / "14" / "task" / str(tid)).mkdir(parents=True)
        (tmp_path / "14" / "task" / str(tid) / "cgroup").write_bytes(text)
    assert ProcFS(tmp_path).cgroup(14) == container.decode()
    # a process that is in the root cgroup stays there
    _write_stat(tmp_path, 20, _stat_line(20, b"host", 20, 100), cgroup=b"0::/\n")
    assert ProcFS(tmp_path).cgroup(20) == "0::/\n"


def test_a_process_in_exit_with_no_other_thread_has_ended(tmp_path):
    # state R, PF_EXITING: past exit(), it may already read the root's cgroup
    _write_stat(tmp_path, 15, _stat_line(15, b"true", 9, 5150, flags=0x40000C))
    assert ProcFS(tmp_path).ended(15)


def test_a_real_process_whose_main_thread_exited_reads_alive(tmp_path):
    script = ("import ctypes, threading, time; "
              "threading.Thread(target=time.sleep, args=(30,)).start(); "
              "print('ready', flush=True); ctypes.CDLL(None).pthread_exit(None)")
    p = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        for _ in range(500):  # until the main thread is gone (no time asserted: state is polled)
            raw = Path(f"/proc/{p.pid}/stat").read_bytes()
            if raw[raw.rfind(b")") + 2:].startswith(b"Z"):
                break
            time.sleep(0.01)
        else:
            pytest.skip("the main thread never read as exited on this kernel")
        stat = ProcFS().stat(p.pid)
        assert stat is not None and stat.pgid == p.pid and not ProcFS().ended(p.pid)
    finally:
        p.kill()
        p.wait()


def test_a_real_process_that_renamed_itself_in_bytes_that_are_not_utf8_reads(tmp_path):
    # the tenant's move on a real kernel: prctl(PR_SET_NAME) with bytes of its choosing
    script = ("import ctypes, sys, time; "
              "assert ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b'\\xff\\xfe) x (y'), 0, 0, 0) == 0; "
              "print('ready', flush=True); time.sleep(30)")
    p = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        assert b"\xff\xfe) x (y" in Path(f"/proc/{p.pid}/stat").read_bytes()
        stat = ProcFS().stat(p.pid)
        assert stat is not None and stat.pid == p.pid and stat.pgid == p.pid and stat.start_ticks > 0
        assert p.pid in ProcFS().group_members(p.pid)
    finally:
        p.kill()
        p.wait()


def test_a_stopped_process_reads_stopped_and_a_real_one_too(tmp_path):
    _write_stat(tmp_path, 20, _stat_line(20, b"held", 20, 1, state=b"T"))
    _write_stat(tmp_path, 21, _stat_line(21, b"traced", 21, 1, state=b"t"))
    _write_stat(tmp_path, 22, _stat_line(22, b"busy", 22, 1, state=b"R"))
    proc = ProcFS(tmp_path)
    assert [proc.stat(p).stopped for p in (20, 21, 22)] == [True, True, False]  # type: ignore[union-attr]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        real = ProcFS()
        child.send_signal(19)  # SIGSTOP
        deadline = time.monotonic() + 5
        while not real.stat(child.pid).stopped and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.01)
        assert real.stat(child.pid).stopped  # type: ignore[union-attr]
        child.send_signal(18)  # SIGCONT: what a tenant's helper sends its held worker
        deadline = time.monotonic() + 5
        while real.stat(child.pid).stopped and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.01)
        assert not real.stat(child.pid).stopped  # type: ignore[union-attr]
    finally:
        child.kill()
        child.wait()


def test_one_scan_answers_every_group(tmp_path):
    for pid, pgid in ((30, 30), (31, 30), (32, 32)):
        _write_stat(tmp_path, pid, _stat_line(pid, b"p", pgid, 1))
    _write_stat(tmp_path, 33, b"33 garbled")
    groups, unreadable = ProcFS(tmp_path).group_index()
    assert {k: sorted(v) for k, v in groups.items()} == {30: [30, 31], 32: [32]}
    assert unreadable == [33]
