"""Reading a proc root for the actuator's safety checks: who a PID is now, and who is in a group.

A PID names a process only until it exits; the kernel then hands the number to the next process
that asks. The isolation loop learns PIDs from a GPU sample and signals later, so before it sends
SIGSTOP or SIGKILL it re-reads who the PID is: the start time (``stat`` field 22, clock ticks
since boot) and the cgroup. PID + start time names one process for the life of the host.

The root is configurable so tests model processes in a directory; in a cluster the manager runs
with ``hostPID`` and reads ``/proc``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcStat:
    """The ``stat`` fields the checks use."""

    pid: int
    pgid: int
    start_ticks: int


class ProcFS:
    """``<root>/<pid>/stat`` and ``<root>/<pid>/cgroup``; a process that ended reads as None."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root

    def _read(self, pid: int, name: str) -> str | None:
        try:
            return (self.root / str(pid) / name).read_text()
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            return None

    def stat(self, pid: int) -> ProcStat | None:
        raw = self._read(pid, "stat")
        if not raw or ")" not in raw:
            return None
        # the command name may hold spaces and parentheses: fields start after the last ')'
        fields = raw.rsplit(")", 1)[1].split()
        if len(fields) < 20 or fields[0] == "Z":  # a zombie has ended; its number may soon be reused
            return None
        return ProcStat(pid, int(fields[2]), int(fields[19]))

    def cgroup(self, pid: int) -> str | None:
        return self._read(pid, "cgroup")

    def group_members(self, pgid: int) -> list[int]:
        """Every live process whose process group is ``pgid`` (a scan of the root: only run when
        a signal is about to be sent, which the engine does on change, not every tick)."""
        members = []
        for entry in self.root.iterdir():
            if entry.name.isdigit():
                stat = self.stat(int(entry.name))
                if stat is not None and stat.pgid == pgid:
                    members.append(stat.pid)
        return sorted(members)
