"""Reading a proc root for the actuator's safety checks: who a PID is now, and who is in a group.

A PID names a process only until it exits; the kernel then hands the number to the next process
that asks. The isolation loop learns PIDs from a GPU sample and signals later, so before it sends
SIGSTOP or SIGKILL it re-reads who the PID is: the start time (``stat`` field 22, clock ticks
since boot) and the cgroup. PID + start time names one process for the life of the host.

Everything here is written by the processes it describes, in part: the command name in ``stat``
(field 2) is up to 15 bytes any process sets for itself (``prctl(PR_SET_NAME)``), not necessarily
UTF-8 (a long UTF-8 file name is cut mid-character), and it may hold spaces and parentheses.
So ``stat`` is parsed as bytes after its last ``)`` and the name is never decoded; a process
that cannot be read or parsed is unknown, never an exception that would stop the loop for
every tenant of the node.

The root is configurable so tests model processes in a directory; in a cluster the manager runs
with ``hostPID`` and reads ``/proc``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# a process that ended between the listing of the root and the read
_GONE = (FileNotFoundError, ProcessLookupError, NotADirectoryError)
_PF_EXITING = 0x4  # stat field 9, flags: the task is in exit()


@dataclass(frozen=True)
class ProcStat:
    """The ``stat`` fields the checks use. ``exiting``: the process is in exit() with no other
    thread left; it runs no code of its own again (its cgroup may already read as the root's)."""

    pid: int
    pgid: int
    start_ticks: int
    exiting: bool = False
    stopped: bool = False  # state T (stopped by a signal) or t (stopped by a tracer)


def stat_fields(raw: bytes, where: str) -> list[bytes]:
    """The fields of a ``stat`` line from field 3 (the state) on, as bytes: ``[0]`` state, ``[2]``
    process group, ``[3]`` session, ``[6]`` flags, ``[17]`` threads, ``[19]`` start time. The
    command name (field 2) may hold spaces and parentheses and need not be UTF-8, so the fields
    start after the last ``)`` and nothing is decoded. ValueError, naming ``where`` (the file),
    when there is no ``)`` or fewer than 22 fields."""
    close = raw.rfind(b")")
    if close < 0:
        raise ValueError(f"{where} has no ')' closing the command name")
    fields = raw[close + 1:].split()
    if len(fields) < 20:
        raise ValueError(f"{where} has {len(fields) + 2} fields, not the 22 or more expected")
    return fields


class ProcFS:
    """``<root>/<pid>/stat`` and ``<root>/<pid>/cgroup``; a process that ended reads as None."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root

    def _stat(self, pid: int) -> ProcStat | None:
        """None when the process ended (or is a zombie, whose number may soon be reused); raises
        OSError or ValueError when it exists but its ``stat`` cannot be read or parsed."""
        try:
            raw = (self.root / str(pid) / "stat").read_bytes()
        except _GONE:
            return None
        fields = stat_fields(raw, f"{self.root}/{pid}/stat")
        state, flags, threads = fields[0], int(fields[6]), int(fields[17])
        # a zombie has ended (its number may soon be reused), unless only its main thread did:
        # the leader of a thread group reads "Z" while the process's other threads run on
        if state in (b"Z", b"X") and threads <= 1:
            return None
        return ProcStat(pid, int(fields[2]), int(fields[19]), exiting=bool(flags & _PF_EXITING) and threads <= 1,
                        stopped=state in (b"T", b"t"))

    def stat(self, pid: int) -> ProcStat | None:
        """The process's group and start time; None when it ended or cannot be read (then
        nothing is known of it, and nothing may be done to it on its account)."""
        try:
            return self._stat(pid)
        except (OSError, ValueError):
            return None

    def ended(self, pid: int) -> bool:
        """True only when no process that will run again has the PID (none, a zombie, one in
        exit() with no other thread): a process whose ``stat`` cannot be read has not been shown
        to have ended."""
        try:
            stat = self._stat(pid)
        except (OSError, ValueError):
            return False
        return stat is None or stat.exiting

    def cgroup(self, pid: int) -> str | None:
        """The cgroup text (bytes that are not UTF-8 kept as surrogates), or None when the
        process ended or the file cannot be read.

        On cgroup v1 a thread-group leader that has exited (``pthread_exit`` in ``main``) reads as
        the root cgroup's while its other threads run on in the container: when the process's own
        file names only the root, the first other thread that can be read says where it is."""
        text = _read_text(self.root / str(pid) / "cgroup")
        if text is None or not _only_root(text):
            return text
        try:
            tasks = sorted((t for t in (self.root / str(pid) / "task").iterdir() if t.name != str(pid)),
                           key=lambda t: t.name)
        except OSError:
            return text
        for task in tasks:
            other = _read_text(task / "cgroup")
            if other is not None:
                return other
        return text

    def group_members(self, pgid: int) -> list[int]:
        """Every live process whose process group is, or may be, ``pgid``: those whose ``stat``
        names it, and those whose ``stat`` cannot be read (they could be in it; the caller must
        treat them as members it cannot vouch for). A scan of the root."""
        groups, unreadable = self.group_index()
        return sorted([*groups.get(pgid, ()), *unreadable])

    def group_index(self) -> tuple[dict[int, list[int]], list[int]]:
        """One scan of the root: the live processes by process group, and those whose ``stat``
        cannot be read (members of any group, as far as anyone can vouch). A caller signalling
        several groups in one pass reads this once (a tenant's thousands of idle processes made
        a scan per group cost the isolation loop seconds)."""
        groups: dict[int, list[int]] = {}
        unreadable: list[int] = []
        for entry in self.root.iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                stat = self._stat(pid)
            except (OSError, ValueError):
                unreadable.append(pid)
                continue
            if stat is not None:
                groups.setdefault(stat.pgid, []).append(pid)
        return groups, unreadable


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", "surrogateescape")
    except OSError:
        return None


def _only_root(cgroup: str) -> bool:
    """Every hierarchy of a ``/proc/<pid>/cgroup`` text names the root (``N:ctrl:/``)."""
    lines = [line for line in cgroup.splitlines() if line.strip()]
    return bool(lines) and all(line.split(":", 2)[-1] == "/" for line in lines)

