"""One node manager per allocation store: a second one waits for the first to stop, then serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from testkubelet import TestKubelet

from qgpu_runtime.node.hostlock import LockError, acquire, holder, lock_path
from tests.polling import poll

NODE = "one-node"
CORE = "tke.cloud.tencent.com/qgpu-core"
REPO = Path(__file__).resolve().parents[2]


def start_manager(root: Path, log: str) -> subprocess.Popen:
    (root / "pods.json").write_text('{"items": []}')
    cmd = [sys.executable, "-m", "qgpu_runtime.cli", "manager", "serve", "--nodename", NODE,
           "--dbfile", str(root / "meta.db"), "--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G",
           "--pods-file", str(root / "pods.json"), "--device-plugin-dir", str(root / "dp"),
           "--pod-resources-socket", str(root / "pr" / "kubelet.sock"), "--state-dir", str(root / "state"),
           "--resources", CORE, "--metrics-port", "-1", "--log-level", "INFO"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(root / log, "a"))


def test_a_second_manager_on_the_same_store_waits_then_serves_once_the_first_stops(short_tmp):
    """Before, both ran: both registered with kubelet and both held and resumed the same containers."""
    root = short_tmp
    kubelet = TestKubelet(root / "dp", root / "pr" / "kubelet.sock")
    kubelet.start()
    first = start_manager(root, "first.log")
    second = None
    try:
        kubelet.wait_for(lambda: len(kubelet.registrations) >= 1, timeout=30)
        second = start_manager(root, "second.log")
        poll(lambda: "holds the allocation store" in (root / "second.log").read_text(), timeout=30)
        assert f"pid {first.pid}," in (root / "second.log").read_text()
        assert len(kubelet.registrations) == 1  # the second registered nothing while it waited
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
        kubelet.wait_for(lambda: len(kubelet.registrations) >= 2, timeout=30)
        assert holder(lock_path(root / "meta.db")) == str(second.pid)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        kubelet.stop()


def test_a_manager_stopped_while_it_waits_exits_0_without_touching_the_store(tmp_path):
    db = tmp_path / "meta.db"
    held = acquire(db, threading.Event())
    assert held is not None
    try:
        stop = threading.Event()
        got: list[int | None] = []
        waiter = threading.Thread(target=lambda: got.append(acquire(db, stop, poll_s=0.01)))
        waiter.start()
        stop.set()
        waiter.join(timeout=10)
        assert got == [None]
        assert not db.exists()
    finally:
        os.close(held)


def test_the_lock_is_free_again_when_its_holder_ends_however_it_ends(tmp_path):
    db = tmp_path / "meta.db"
    script = ("import sys, threading, os; from pathlib import Path; from qgpu_runtime.node.hostlock import acquire; "
              "acquire(Path(sys.argv[1]), threading.Event()); os.kill(os.getpid(), 9)")
    done = subprocess.run([sys.executable, "-c", script, str(db)], cwd=REPO)
    assert done.returncode == -signal.SIGKILL
    fd = acquire(db, threading.Event())
    assert fd is not None
    os.close(fd)


def test_a_lock_file_that_cannot_be_opened_is_an_error_naming_the_flag_and_path(tmp_path):
    (tmp_path / "meta.db.lock").mkdir()
    with pytest.raises(LockError, match=r"--dbfile .*meta\.db: cannot open its lock file .*meta\.db\.lock"):
        acquire(tmp_path / "meta.db", threading.Event())


def test_two_names_of_one_store_are_one_lock(tmp_path):
    """A link to the store (or another spelling of its path) locks the same file: two managers given
    the two names would otherwise both serve one store."""
    db = tmp_path / "meta.db"
    link = tmp_path / "other-name.db"
    link.symlink_to(db)
    assert lock_path(link) == lock_path(db)
    held = acquire(db, threading.Event())
    assert held is not None
    stop, got = threading.Event(), []
    second = threading.Thread(target=lambda: got.append(acquire(link, stop, poll_s=0.05)))
    second.start()
    second.join(1.0)  # it waits for the first holder (a lock of its own would have been taken at once)
    stop.set()
    second.join(30)
    os.close(held)
    assert got == [None]
