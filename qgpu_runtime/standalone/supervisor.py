"""Runs one booked job and guarantees its booking is released however the job ends.

The job runs in its own session (its own process group), so the isolation manager can suspend the
whole job with one signal and terminal signals reach it only through us. The supervisor forwards
SIGINT/SIGTERM/SIGHUP/SIGQUIT to the job's group (a second Ctrl-C kills it), waits, and releases
the booking in a ``finally`` unless processes of the job's session outlived its command. If the
supervisor itself is killed outright, the kernel kills the job's leader (PR_SET_PDEATHSIG); the
leader's own children may live on, and the booking stays while any process of the session lives
(:func:`store.job_processes`); the next reader of the database reaps it after the last one.

The command runs only once its process group is recorded (:func:`start_gated`): the child makes
its session, then waits on a pipe before ``exec``; the supervisor records the child's pid as the
job's process group and only then releases it. A supervisor killed before that (``kill -9``
while the database is locked, say) closes the pipe with its death, and the child exits without
running anything: no process of the job can run unrecorded, which the reaper could not follow.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

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
        self.pgid: int | None = None
        self.pending: list[int] = []
        self.interrupts = 0

    def __call__(self, signum: int, _frame: object) -> None:
        if self.pgid is None:
            self.pending.append(signum)
        else:
            self._deliver(signum, self.pgid)

    def started(self, pgid: int) -> None:
        self.pgid = pgid
        for signum in self.pending:
            self._deliver(signum, pgid)

    def _deliver(self, signum: int, pgid: int) -> None:
        self.interrupts += signum == signal.SIGINT
        sig = signal.SIGKILL if self.interrupts >= 2 else signum
        try:
            os.killpg(pgid, signal.SIGCONT)  # a held job cannot act on the signal until resumed
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass


_READY = b"R"
_GO = b"G"
# what ``exec`` resets in a child (a caught signal goes back to its default) and what Python
# itself set at start (SIGPIPE ignored, SIGXFSZ ignored), as subprocess's restore_signals does
_RESTORED = tuple(getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name))


@dataclass
class GatedChild:
    """A child in a session of its own, stopped before ``exec`` until :meth:`release`."""

    pid: int
    _gate: int
    _status: int

    def release(self) -> OSError | None:
        """Let the child run the command; the OSError ``exec`` failed with, or None once it runs.
        A child that already died (a signal while it waited) reads as started: wait() tells how it ended."""
        if self._gate < 0:  # abandoned: it died before it was ready
            return None
        try:
            os.write(self._gate, _GO)
        except BrokenPipeError:
            pass
        finally:
            os.close(self._gate)
            self._gate = -1
        try:
            failed = _read_all(self._status)
        finally:
            os.close(self._status)
        if not failed:
            return None
        code = int(failed)
        return OSError(code, os.strerror(code))

    def abandon(self) -> None:
        """Never run the command: the child reads end-of-file at the gate and exits."""
        if self._gate >= 0:
            os.close(self._gate)
            self._gate = -1
            os.close(self._status)

    def wait(self) -> int:
        """Its return code as subprocess gives it: the exit code, or -N when signal N ended it."""
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 64):
        chunks.append(chunk)
    return b"".join(chunks)


def start_gated(command: Sequence[str], env: Mapping[str, str], caught: Iterable[int]) -> GatedChild:
    """Fork a child that makes its own session (session ID = process group ID = its pid), asks to
    be killed with its parent, resets the signals in ``caught`` to their default (as ``exec``
    would), and then waits on a pipe; only :meth:`GatedChild.release` lets it ``exec`` the
    command. If the parent dies first, the pipe's write end closes with it and the child exits
    (status 125) without running anything, if PR_SET_PDEATHSIG did not kill it already.

    Returns once the child is in its session, so signals to its group reach it. A failed
    ``exec`` comes back from ``release`` as the OSError, as ``subprocess.Popen`` raises it.

    Not ``subprocess.Popen`` with a waiting ``preexec_fn``: Popen returns only after ``exec``,
    so a child that waited for its parent there would wait for ever."""
    caught = tuple(caught)
    gate_r, gate_w = os.pipe()
    status_r, status_w = os.pipe()  # close-on-exec: end-of-file tells the parent exec succeeded
    # Blocked across fork, so a Ctrl-C to the terminal's group (the child is in it until setsid)
    # runs no Python handler of ours in the child; the child unblocks once its handlers are reset.
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, caught)
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        for fd in (gate_r, gate_w, status_r, status_w):
            os.close(fd)
        raise
    if pid == 0:  # the child: never returns
        code = 125
        try:
            os.close(gate_w)
            os.close(status_r)
            os.setsid()
            _die_with_parent()
            for sig in (*caught, *_RESTORED):
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
            os.write(status_w, _READY)
            if os.read(gate_r, 1) == _GO:
                os.close(gate_r)
                os.closerange(3, status_w)
                os.closerange(status_w + 1, os.sysconf("SC_OPEN_MAX"))
                code = 127
                os.execvpe(command[0], list(command), dict(env))
        except OSError as err:
            try:
                os.write(status_w, str(err.errno or errno.EIO).encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
    os.close(gate_r)
    os.close(status_w)
    child = GatedChild(pid, gate_w, status_r)
    try:
        ready = os.read(status_r, 1)
    except BaseException:
        child.abandon()
        raise
    if ready != _READY:  # died before it was ready (killed): nothing ran; wait() tells how it ended
        child.abandon()
    return child


def supervise(
    command: Sequence[str],
    env: Mapping[str, str],
    on_started: Callable[[int], None],
    release: Callable[[], None],
) -> int:
    """Start ``command``, record its pid (= process group) through ``on_started`` before it runs,
    forward signals, wait, release.

    The forwarding is in place before the job starts, so a signal that arrives while it starts
    reaches it (before or once it runs). A signal qgpu was started ignoring (``nohup``; a script's
    ``cmd &`` ignores SIGINT and SIGQUIT) stays ignored, by the job too, as a shell would leave it.
    ``on_started`` runs while the command waits at its gate (:func:`start_gated`); if it fails,
    the command never runs.
    """
    forward = _Forwarder()
    # Caught here, a forwarded signal is at its default in the job: the child resets what we catch.
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        try:
            child = start_gated(command, env, previous)
        except OSError as err:
            release()
            print(f"qgpu run: cannot start {command[0]!r}: {err.strerror}", file=sys.stderr)
            return 126
        try:
            forward.started(child.pid)
            try:
                on_started(child.pid)
            except BaseException:
                child.abandon()
                child.wait()
                raise
            failed = child.release()
            if failed is not None:
                child.wait()
                print(f"qgpu run: cannot start {command[0]!r}: {failed.strerror}", file=sys.stderr)
                return 127 if isinstance(failed, FileNotFoundError) else 126
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
