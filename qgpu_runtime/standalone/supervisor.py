"""Runs one booked job and guarantees its booking is released however the job ends.

The job runs in its own session (its own process group), so the isolation manager can suspend the
whole job with one signal and terminal signals reach it only through us. The supervisor forwards
SIGINT/SIGTERM/SIGHUP/SIGQUIT to the job's group (a second Ctrl-C kills it), waits, and releases
the booking in a ``finally`` unless processes of the job's session outlived its command. If the
supervisor itself is killed outright, the kernel kills the job's leader (PR_SET_PDEATHSIG); the
leader's own children may live on, and the booking stays while any process of the session lives
(:func:`store.job_processes`); the next reader of the database reaps it after the last one.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Callable, Mapping, Sequence

from qgpu_runtime.isolation.mps import client_env
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.standalone.store import JobRecord

PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _die_with_parent() -> None:
    """In the child before exec: ask the kernel to SIGKILL us when the supervisor dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the reaper still releases the booking once the job is gone


def job_environment(base: Mapping[str, str], job: JobRecord, policy: Policy, mps: Mapping[str, str] | None) -> dict[str, str]:
    """The job's environment: its cards by UUID, its quota, and MPS client settings when MPS runs.

    ``mps`` (from the manager's meta: pipe_dir, log_dir, pinned '1'/'0') is applied only to
    single-card shared jobs; the thread percentage caps compute only under fixed-share, since
    best-effort and burst-share must be free to use idle capacity.
    """
    uuids = ",".join(s.uuid for s in job.shares)
    env = dict(base)
    env.update({
        "CUDA_VISIBLE_DEVICES": uuids,
        "NVIDIA_VISIBLE_DEVICES": uuids,
        "QGPU_JOB_ID": job.id,
        "QGPU_CLASS": job.klass,
        "QGPU_POLICY": policy.value,
        "QGPU_CORE_MILLI": str(job.core_milli),
        "QGPU_MEMORY_MIB": str(job.memory_mib),
    })
    if mps and len(job.shares) == 1 and not job.exclusive:
        core = job.core_milli if policy is Policy.FIXED_SHARE else 0
        env.update(client_env(mps["pipe_dir"], mps["log_dir"], core, job.memory_mib, mps.get("pinned") == "1"))
    return env


def exit_status(returncode: int) -> int:
    """A shell's view of how the job ended: its code, or 128 + the signal that killed it."""
    return 128 - returncode if returncode < 0 else returncode


class _Forwarder:
    """Passes the signals qgpu run receives on to the job's process group; a signal that arrives
    before the job exists is kept and passed on once it does. A second SIGINT kills the job."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []
        self.interrupts = 0

    def __call__(self, signum: int, _frame: object) -> None:
        if self.child is None:
            self.pending.append(signum)
        else:
            self._deliver(signum, self.child)

    def started(self, child: subprocess.Popen[bytes]) -> None:
        self.child = child
        for signum in self.pending:
            self._deliver(signum, child)

    def _deliver(self, signum: int, child: subprocess.Popen[bytes]) -> None:
        self.interrupts += signum == signal.SIGINT
        sig = signal.SIGKILL if self.interrupts >= 2 else signum
        try:
            os.killpg(child.pid, signal.SIGCONT)  # a held job cannot act on the signal until resumed
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            pass


def supervise(
    command: Sequence[str],
    env: Mapping[str, str],
    on_started: Callable[[int], None],
    release: Callable[[], None],
) -> int:
    """Start ``command``, report its pid (= process group), forward signals, wait, release.

    The forwarding is in place before the job starts, so a signal that arrives while it starts
    reaches it once it runs. A signal qgpu was started ignoring (``nohup``; a script's ``cmd &``
    ignores SIGINT and SIGQUIT) stays ignored, by the job too, as a shell would leave it.
    """
    forward = _Forwarder()
    # Caught here, a forwarded signal is at its default in the job: exec resets a caught signal.
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        try:
            child = subprocess.Popen(list(command), env=dict(env), start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as err:
            release()
            print(f"qgpu run: cannot start {command[0]!r}: {err.strerror}", file=sys.stderr)
            return 127 if isinstance(err, FileNotFoundError) else 126
        try:
            forward.started(child)
            on_started(child.pid)
            return exit_status(child.wait())
        finally:
            try:
                os.killpg(child.pid, signal.SIGCONT)  # never leave stragglers of the group frozen
            except ProcessLookupError:
                pass
            release()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
