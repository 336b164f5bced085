"""Which qgpu container a GPU process belongs to, and what that container booked.

NVML (or the simulated backend) names processes by host PID only. The way from a PID to a
booking is: ``<proc>/<pid>/cgroup`` → pod UID + container ID (node/cgroups.py, cgroupfs and
systemd layouts) → the pod's ``containerStatuses`` → container name → the store's shares for
(pod UID, container). A process that does not end in a share (a host process, a pod that holds
no qgpu share, a container another device plugin serves) is not ours to throttle: it is left
alone and logged once.

Process groups (``<proc>/<pid>/stat`` field 5) are what the actuator signals, so a container's
GPU process is held together with the children in its group. The proc root is configurable so
tests read a fake one; in a cluster the manager runs with ``hostPID`` and reads ``/proc``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from qgpu_runtime.isolation.engine import CardQuota, Workload
from qgpu_runtime.model import AppClass
from qgpu_runtime.node.cgroups import container_id, pod_and_container
from qgpu_runtime.node.store import Share

log = logging.getLogger("qgpu.node.isolation")

FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True)
class ContainerRef:
    """A qgpu container as the isolation engine knows it; ``key`` is ``namespace/pod/container``."""

    pod_uid: str
    namespace: str
    pod: str
    container: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


def workloads_of(shares: Iterable[Share], live_uids: Iterable[str]) -> dict[str, tuple[ContainerRef, Workload]]:
    """The engine's workloads: one per container of a live pod that holds shares, by key.

    Rows of pods that are gone are skipped (reconciliation releases them at the next start), so
    a pod re-created under the same name never collides with its predecessor's rows.
    """
    live = set(live_uids)
    cards: dict[ContainerRef, list[CardQuota]] = {}
    klass: dict[ContainerRef, AppClass] = {}
    for s in shares:
        if s.workload_id not in live:
            continue
        ref = ContainerRef(s.workload_id, s.namespace, s.workload, s.container)
        cards.setdefault(ref, []).append(CardQuota(s.card_index, s.core_milli, s.memory_mib))
        klass[ref] = AppClass(s.klass)
    return {ref.key: (ref, Workload(ref.key, klass[ref], tuple(sorted(cs, key=lambda c: c.index))))
            for ref, cs in cards.items()}


class ContainerResolver:
    """Maps host PIDs to qgpu containers and containers to their process groups.

    ``update`` gives it the pods of the node and the store's shares; ``owner`` is the sampler's
    attribution callback; ``groups`` is the actuator's. A PID once attributed stays attributed
    while it lives (``update`` drops the dead), so a process held in one tick is resumed even if
    a later sample happens not to list it.
    """

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = proc_root
        self._refs: dict[str, ContainerRef] = {}  # key -> container
        self._by_container_id: dict[str, str] = {}  # container id -> key
        self._booked_uids: set[str] = set()
        self._pids: dict[int, str] = {}  # pid -> key
        self._logged: set[tuple[int, str]] = set()  # (pid, start time) of unmanaged processes already logged
        self.unmanaged: set[int] = set()  # GPU processes seen in the last sample that are not ours
        self.unknown_containers = 0  # processes of booked pods whose container ID the pod list lacks

    def update(self, pods: Iterable[Mapping[str, Any]], shares: Iterable[Share]) -> list[Workload]:
        """Take the node's pods and the store's shares; returns the workloads to isolate."""
        live: dict[str, Mapping[str, Any]] = {}
        for pod in pods:
            meta = pod.get("metadata") or {}
            # a terminating pod is let go (resumed) so its containers can handle SIGTERM
            if (pod.get("status") or {}).get("phase") in FINISHED or meta.get("deletionTimestamp"):
                continue
            live[str(meta.get("uid", ""))] = pod
        found = workloads_of(shares, live)
        previous = set(self._refs)
        self._refs = {key: ref for key, (ref, _) in found.items()}
        self._booked_uids = {ref.pod_uid for ref in self._refs.values()}
        keys = {(ref.pod_uid, ref.container): key for key, ref in self._refs.items()}
        self._by_container_id = {}
        for uid, pod in live.items():
            status = pod.get("status") or {}
            for st in (status.get("containerStatuses") or []):
                key = keys.get((uid, st.get("name", "")))
                if key is not None and st.get("containerID"):
                    self._by_container_id[container_id(st["containerID"])] = key
        # pids of a container that just left are kept until the next update, so the engine can
        # still resume them in the tick that sees it gone
        self._pids = {pid: key for pid, key in self._pids.items()
                      if (key in self._refs or key in previous) and self._alive(pid)}
        return [w for _, w in found.values()]

    def ref(self, key: str) -> ContainerRef:
        return self._refs[key]

    def known(self, key: str) -> bool:
        return key in self._refs

    def begin_sample(self) -> None:
        self.unmanaged = set()
        self.unknown_containers = 0

    def owner(self, pid: int) -> str | None:
        """The key of the qgpu container ``pid`` runs in, or None (left alone, logged once)."""
        cgroup = self._read(pid, "cgroup")
        if cgroup is None:
            return None  # ended between the sample and now
        found = pod_and_container(cgroup)
        key = None
        why = "not in a Kubernetes pod"
        if found is not None:
            uid, cid = found
            key = self._by_container_id.get(cid)
            if key is None and uid in self._booked_uids:
                self.unknown_containers += 1
                why = f"in pod {uid}, container {cid[:12]} not (yet) in the pod's status"
            elif key is None:
                why = f"in pod {uid}, which holds no qgpu share"
            elif self._refs[key].pod_uid != uid:
                key, why = None, f"container {cid[:12]} is listed under another pod than its cgroup's {uid}"
        if key is None:
            self.unmanaged.add(pid)
            stamp = (pid, self._start_time(pid))
            if stamp not in self._logged:
                self._logged.add(stamp)
                log.info("GPU process %d is %s: left alone", pid, why)
            return None
        self._pids[pid] = key
        return key

    def pids(self, key: str) -> list[int]:
        return sorted(pid for pid, k in self._pids.items() if k == key)

    def groups(self, key: str) -> list[int]:
        """Process groups of the container's GPU processes (what SIGSTOP/SIGCONT are sent to)."""
        groups = {g for g in (self.process_group(pid) for pid in self.pids(key)) if g is not None}
        return sorted(groups)

    def process_group(self, pid: int) -> int | None:
        fields = self._stat_fields(pid)
        return int(fields[2]) if fields else None

    # -- /proc reading --------------------------------------------------------------------------
    def _read(self, pid: int, name: str) -> str | None:
        try:
            return (self.proc_root / str(pid) / name).read_text()
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            return None

    def _alive(self, pid: int) -> bool:
        return (self.proc_root / str(pid)).is_dir()

    def _stat_fields(self, pid: int) -> list[str] | None:
        """Fields of ``stat`` after the command name (which may hold spaces and parentheses)."""
        stat = self._read(pid, "stat")
        if not stat or ")" not in stat:
            return None
        fields = stat.rsplit(")", 1)[1].split()
        return fields if len(fields) > 19 else None

    def _start_time(self, pid: int) -> str:
        fields = self._stat_fields(pid)
        return fields[19] if fields else ""
