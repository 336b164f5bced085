"""A modelled node for the isolation loop's tests: a proc root, a kernel stand-in, cgroup texts.

Used by tests/node/test_node_isolation.py and tests/k8s/test_e2e_node_isolation.py. Signals are
delivered to simulated processes, never to the test host (made-up process groups could be real).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Callable

from qgpu_runtime.isolation.simbackend import SimProcessSampler
from qgpu_runtime.isolation.simgpu import SimulatedGPU


class FakeProc:
    """A proc root: ``<pid>/cgroup`` and ``<pid>/stat`` for every process that exists."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def add(self, pid: int, cgroup: str, pgid: int, start_time: int = 1000, comm: bytes = b"python (w) 1",
            state: bytes = b"S", threads: int = 1) -> None:
        """``comm`` is the command name as the kernel shows it: up to 15 bytes the process chose
        (``prctl(PR_SET_NAME)``), not necessarily UTF-8; the default has a space and a parenthesis,
        as real ones may. A process whose main thread exited while others run reads ``state``
        ``Z`` with ``threads`` > 1."""
        d = self.root / str(pid)
        d.mkdir()
        (d / "cgroup").write_text(cgroup)
        (d / "stat").write_bytes(b"%d (%s) %s 1 %d %d 0 -1 4194560 " % (pid, comm, state, pgid, pgid) + b"0 " * 10
                                 + b"%d 0 %d 0 0\n" % (threads, start_time))

    def set_state(self, pid: int, state: bytes) -> None:
        """What ``stat`` field 3 says now (``T`` once stopped, ``S`` once continued)."""
        path = self.root / str(pid) / "stat"
        raw = path.read_bytes()
        head, tail = raw.rsplit(b")", 1)
        fields = tail.split(b" ")
        fields[1] = state  # tail starts with the space after ")": ["", state, ppid, ...]
        path.write_bytes(head + b")" + b" ".join(fields))

    def remove(self, pid: int) -> None:
        for f in (self.root / str(pid)).iterdir():
            f.unlink()
        (self.root / str(pid)).rmdir()

    def group(self, pgid: int) -> list[int]:
        out = []
        for d in self.root.iterdir():
            fields = (d / "stat").read_bytes().rsplit(b")", 1)[1].split()
            if int(fields[2]) == pgid:
                out.append(int(d.name))
        return sorted(out)


class SimKernel:
    """Delivers process-group signals to simulated processes, and remembers every one sent."""

    def __init__(self, proc: FakeProc, gpus: dict[int, SimulatedGPU]) -> None:
        self.proc = proc
        self.gpus = gpus
        self.sent: list[tuple[int, signal.Signals]] = []
        self.handlers: dict[tuple[int, signal.Signals], Callable[[], None]] = {}
        """(pid, signal) -> what the process does on that signal instead of the default action
        (a SIGTERM handler); SIGKILL, SIGSTOP and SIGCONT cannot be caught. A handler runs when
        the process is next scheduled (:meth:`run_handlers`), not inside the sender's ``kill``."""
        self._pending: list[Callable[[], None]] = []

    def killpg(self, pgid: int, sig: int) -> None:
        members = self.proc.group(pgid)
        if not members:
            raise ProcessLookupError(pgid)
        self.sent.append((pgid, signal.Signals(sig)))
        for pid in members:
            handler = self.handlers.get((pid, signal.Signals(sig)))
            if handler is not None and sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT):
                self._pending.append(handler)
                continue
            self.deliver(pid, signal.Signals(sig))

    def deliver(self, pid: int, sig: signal.Signals) -> None:
        """One process receives ``sig`` (also what a tenant's own process sends it: it has the right)."""
        for gpu in self.gpus.values():
            if sig == signal.SIGSTOP:
                gpu.suspend(pid)
            elif sig == signal.SIGCONT:
                gpu.resume(pid)
            elif sig in (signal.SIGTERM, signal.SIGKILL):
                gpu.exit(pid)
        if sig in (signal.SIGTERM, signal.SIGKILL):
            self.proc.remove(pid)
        elif sig == signal.SIGSTOP:
            self.proc.set_state(pid, b"T")
        elif sig == signal.SIGCONT:
            self.proc.set_state(pid, b"S")

    def run_handlers(self) -> None:
        """The processes that caught a signal run their handlers (call once per tick)."""
        pending, self._pending = self._pending, []
        for handler in pending:
            handler()

    def signalled(self, pgid: int) -> list[signal.Signals]:
        return [s for g, s in self.sent if g == pgid]


def cgroupfs(uid: str, cid: str) -> str:
    return f"12:devices:/kubepods/burstable/pod{uid}/{cid}\n11:memory:/kubepods/burstable/pod{uid}/{cid}\n"


def systemd(uid: str, cid: str) -> str:
    return f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid.replace('-', '_')}.slice/cri-containerd-{cid}.scope\n"


def cid_of(n: int) -> str:
    return f"{n:x}".rjust(64, "c")


class AdvancingSampler:
    """Runs the simulated cards for the time the manager's loop really waited, then samples them."""

    def __init__(self, gpus: dict[int, SimulatedGPU], owner) -> None:
        self._gpus = gpus
        self._sampler = SimProcessSampler(gpus, owner)

    def sample(self, workloads, dt_s, held, slotted=None):
        for gpu in self._gpus.values():
            gpu.advance(dt_s)
        return self._sampler.sample(workloads, dt_s, held, slotted)
