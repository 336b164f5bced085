import os
import shutil
import sqlite3
import tempfile

import pytest

from .helpers import qgpu, rows, stop, wait_for


@pytest.fixture
def db(tmp_path):
    return tmp_path / "host.db"


@pytest.fixture
def manager(tmp_path, db):
    """Start `qgpu manager serve --standalone` on simulated cards; yields a starter."""
    started = []

    def start(policy: str = "best-effort", gpus: str = "1xT4-16G", *extra: str):
        p = qgpu("manager", "serve", "--standalone", "--dbfile", str(db), "--gpu-backend", "simulated",
                 "--simulated-gpus", gpus, "--policy", policy, "--simulated-usage", str(tmp_path / "usage.json"), *extra)
        started.append(p)
        def ready():
            try:
                return db.exists() and rows(db, "SELECT value FROM meta WHERE key='policy'")
            except sqlite3.Error:
                return False

        wait_for(ready)
        return p

    yield start
    for p in started:
        stop(p)


@pytest.fixture
def no_nvidia_driver():
    """The NVML-failure tests need a host without a driver (CI); on a GPU host they do not apply."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return
    pynvml.nvmlShutdown()
    pytest.skip("an NVIDIA driver is present: NVML does not fail here")


@pytest.fixture
def open_folder():
    """A folder every user may enter (a test's tmp_path is its owner's only) and only its owner may write."""
    folder = tempfile.mkdtemp(prefix="qgpu-standalone-", dir="/tmp")
    os.chmod(folder, 0o755)
    yield folder
    os.chmod(folder, 0o755)
    shutil.rmtree(folder)
