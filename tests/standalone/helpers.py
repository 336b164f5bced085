"""Run the real `qgpu` commands as subprocesses against a temporary standalone database."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.polling import poll as wait_for  # noqa: F401 - the tests import it from here

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["PYTHONUNBUFFERED"] = "1"
    return e


def from_a_terminal() -> None:
    """In the child: SIGINT and SIGQUIT at their default, as a shell at a terminal starts a command,
    whatever the test run itself was started with (a script's ``cmd &`` ignores both)."""
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def qgpu(*args: str, **kw) -> subprocess.Popen:
    kw.setdefault("preexec_fn", from_a_terminal)
    return subprocess.Popen([sys.executable, "-m", "qgpu_runtime.cli", *args], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def qgpu_done(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", *args], env=env(),
                          capture_output=True, text=True, timeout=timeout)


def rows(db: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def proc_state(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return raw[raw.rindex(")") + 2]


def job_pgids(db: Path) -> dict[str, int]:
    """Running jobs by name; empty while the database is still being created."""
    try:
        return {r[0]: r[1] for r in rows(db, "SELECT name, pgid FROM jobs WHERE pgid IS NOT NULL")}
    except sqlite3.OperationalError:
        return {}


def stop(p: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
    if p.poll() is None:
        p.send_signal(sig)
    return p.wait(timeout=timeout)


def write_json(path: Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


NOBODY = 65534


def as_another_user(folder: str):
    """A ``preexec_fn`` for a command run as a user who may not write ``folder`` nor its files:
    root runs it as nobody; anyone else takes the write permission away from itself (returns None)."""
    if os.geteuid() == 0:
        def drop() -> None:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        return drop
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o444)
    os.chmod(folder, 0o555)
    return None
