"""Which qgpu container a GPU process belongs to, and what that container booked.

NVML (or the simulated backend) names processes by host PID only. The way from a PID to a
booking is: ``<proc>/<pid>/cgroup`` → pod UID + container ID (node/cgroups.py, cgroupfs and
systemd layouts) → the pod's ``containerStatuses`` → container name → the tenant that container
belongs to (node/tenants.py: the store's shares booked for it by the device plugin, or those of
the ResourceClaims it references, whichever door booked them). A process that does not end in a
share (a host process, a pod that holds no qgpu share, a container another device plugin serves)
is not ours to throttle: it is left alone and logged once. A pod kept oversized (node/tenants.py
``WHOLE_POD``) has no statuses kept: each process in it goes, by its cgroup's pod UID, to the one
member the pod is.

Process groups (``<proc>/<pid>/stat`` field 5) are what the actuator signals, so a container's
GPU process is held together with the children in its group. The proc root is configurable so
tests read a fake one; in a cluster the manager runs with ``hostPID`` and reads ``/proc``.

A PID is re-identified whenever its groups are asked for, i.e. just before a signal: its start
time must be the one seen when it was attributed and its cgroup must still be the container's,
or it was reused by another process and is dropped. A group is signalled only if every process
in it is the container's: a shared or foreign group is left alone and logged.

A pod being deleted keeps its booking until it is gone, so it stays enforced: a tenant cannot
shed its share by deleting its own pod with a long ``terminationGracePeriodSeconds``. Only for
``TERMINATING_UNHELD_S`` from the moment this manager first saw it terminating (its own monotonic
clock: ``deletionTimestamp`` is only read as "set", its wall time is the apiserver's) is it left
unheld, so that a process that was held can run its SIGTERM handler (a tenant of several pods:
once all of them are being deleted, from the first); its memory is judged throughout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from qgpu_runtime.contract.names import finished
from qgpu_runtime.isolation.engine import Workload
from qgpu_runtime.isolation.procfs import ProcFS
from qgpu_runtime.node.cgroups import container_id, pod_and_container
from qgpu_runtime.node.store import PreparedClaim, Share
from qgpu_runtime.node.tenants import WHOLE_POD, TenantRef, tenants_of

log = logging.getLogger("qgpu.node.isolation")

TERMINATING_UNHELD_S = 30.0
"""How long a pod being deleted is left unheld (resumed, never held) to handle its SIGTERM, from
when this manager first saw it terminating; then its share is enforced again until it is gone.
Kubernetes' default ``terminationGracePeriodSeconds`` is as long, so a pod that honours SIGTERM
is gone before its window ends."""
GROUP_INDEX_S = 0.5
"""How long one scan of /proc by process group answers signals (a tick is 50 ms)."""


@dataclass(frozen=True)
class _Attributed:
    """Who a PID was when the sampler attributed it: re-checked before every signal."""

    key: str
    start_ticks: int
    container: tuple[str, str] | None  # (pod UID, container ID) of its cgroup


class ContainerResolver:
    """Maps host PIDs to qgpu containers and containers to their process groups.

    ``update`` gives it the pods of the node, the store's shares and its prepared claims;
    ``owner`` is the sampler's attribution callback; ``groups`` is the actuator's. A PID once attributed stays attributed
    while it lives (``update`` drops the dead), so a process held in one tick is resumed even if
    a later sample happens not to list it.
    """

    def __init__(self, proc_root: Path = Path("/proc"), clock: Callable[[], float] = time.monotonic) -> None:
        self.proc_root = proc_root
        self._clock = clock
        self._workloads: list[Workload] = []
        self._terminating_since: dict[str, float] = {}  # pod UID -> when this manager first saw it terminating
        self._terminating_keys: dict[str, float] = {}  # workload key -> earliest of its pods' times above
        self._refs: dict[str, TenantRef] = {}  # key -> tenant
        self._by_container_id: dict[str, tuple[str, str]] = {}  # container id -> (key, pod UID listing it)
        self._booked_uids: set[str] = set()
        self._by_pod: dict[str, str] = {}  # pod UID -> key, for a pod kept oversized (WHOLE_POD)
        self._proc = ProcFS(proc_root)
        self._pids: dict[int, _Attributed] = {}
        # /proc by process group, one scan serving the signals of GROUP_INDEX_S (a group's members
        # are its session's: nobody outside the container joins one later)
        self._group_index: tuple[dict[int, list[int]], list[int]] | None = None
        self._group_index_at = 0.0
        self._outsiders_logged: set[tuple[int, tuple[int, ...]]] = set()  # (group, outsiders) warned of
        self._logged: set[tuple[int, str]] = set()  # (pid, start time) of unmanaged processes already logged
        self.unmanaged: set[int] = set()  # GPU processes seen in the last sample that are not ours
        self.unknown_containers = 0  # processes of booked pods whose container ID the pod list lacks

    def update(self, pods: Iterable[Mapping[str, Any]], shares: Iterable[Share],
               claims: Sequence[PreparedClaim] = ()) -> list[Workload]:
        """Take the node's pods, the store's shares and prepared claims; returns the workloads to
        isolate (as :meth:`workloads`). Rows of pods that are gone reach no container
        (reconciliation or kubelet's unprepare releases them), so a pod re-created under the same
        name never collides with its predecessor's rows."""
        now = self._clock()
        # unmanaged processes are logged once each while they live; the memory of it goes with them
        self._logged = {stamp for stamp in self._logged if self._alive(stamp[0])}
        live: dict[str, Mapping[str, Any]] = {}
        terminating: dict[str, float] = {}
        for pod in pods:
            meta = pod.get("metadata") or {}
            if finished(pod):
                continue
            uid = str(meta.get("uid", ""))
            live[uid] = pod
            if meta.get("deletionTimestamp"):
                terminating[uid] = self._terminating_since.get(uid, now)
        self._terminating_since = terminating
        found = tenants_of(shares, claims, live)
        previous = set(self._refs)
        self._refs = {key: ref for key, (ref, _) in found.items()}
        keys = {(m.pod_uid, m.container): key for key, ref in self._refs.items() for m in ref.members}
        self._booked_uids = {uid for uid, _ in keys}
        self._by_pod = {uid: key for (uid, container), key in keys.items() if container == WHOLE_POD}
        self._by_container_id = {}
        for uid, pod in live.items():
            status = pod.get("status") or {}
            for st in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
                key = keys.get((uid, st.get("name", "")))
                if key is not None and st.get("containerID"):
                    self._by_container_id[container_id(st["containerID"])] = (key, uid)
        # pids of a container that just left are kept until the next update, so the engine can
        # still resume them in the tick that sees it gone
        self._pids = {pid: seen for pid, seen in self._pids.items()
                      if (seen.key in self._refs or seen.key in previous) and self._alive(pid)}
        self._workloads = [w for _, w in found.values()]
        # a tenant of several pods (one claim shared) is let run only once all of them are being
        # deleted, and from when the first was: were one deletion enough, deleting a fresh member
        # pod every window would keep the others unheld for good
        self._terminating_keys = {}
        for key, ref in self._refs.items():
            uids = {m.pod_uid for m in ref.members}
            if uids <= terminating.keys():
                self._terminating_keys[key] = min(terminating[uid] for uid in uids)
        return self.workloads()

    def workloads(self) -> list[Workload]:
        """The workloads of the last :meth:`update`, those of pods being deleted marked unheld
        while their window lasts (asked every tick, so the window ends on time even while the
        pod list cannot be read)."""
        now = self._clock()
        return [replace(w, unheld=True) if self._in_unheld_window(w.key, now) else w for w in self._workloads]

    def _in_unheld_window(self, key: str, now: float) -> bool:
        since = self._terminating_keys.get(key)
        return since is not None and now - since < TERMINATING_UNHELD_S

    def ref(self, key: str) -> TenantRef:
        return self._refs[key]

    def known(self, key: str) -> bool:
        return key in self._refs

    def begin_sample(self) -> None:
        self.unmanaged = set()
        self.unknown_containers = 0

    def running(self, key: str) -> bool:
        """Whether a GPU process of ``key`` (still the process it was) is not stopped: a held
        workload's processes resumed by someone else (a helper of the tenant sending SIGCONT)."""
        for pid in self.pids(key):
            seen = self._pids[pid]
            stat = self._proc.stat(pid)
            if stat is not None and stat.start_ticks == seen.start_ticks and not stat.stopped and not stat.exiting:
                return True
        return False

    def owner(self, pid: int) -> str | None:
        """The key of the qgpu container ``pid`` runs in, or None (left alone, logged once)."""
        cgroup = self._proc.cgroup(pid)
        stat = self._proc.stat(pid)
        if cgroup is None or stat is None:
            return None  # ended between the sample and now
        key, why, pending = self._container_of(cgroup)
        self.unknown_containers += pending
        if key is None:
            self.unmanaged.add(pid)
            stamp = (pid, str(stat.start_ticks))
            if stamp not in self._logged:
                self._logged.add(stamp)
                log.info("GPU process %d is %s: left alone", pid, why)
            return None
        self._pids[pid] = _Attributed(key, stat.start_ticks, pod_and_container(cgroup))
        return key

    def _container_of(self, cgroup: str) -> tuple[str | None, str, bool]:
        """The key of the qgpu container a cgroup text names, or None and why not; the flag says
        the pod is booked but its container is not (yet) in the pod's status."""
        found = pod_and_container(cgroup)
        if found is None:
            return None, "not in a Kubernetes pod", False
        uid, cid = found
        listed = self._by_container_id.get(cid)
        if listed is None and uid in self._by_pod:  # a pod kept oversized: any container of it
            return self._by_pod[uid], "", False
        if listed is None and uid in self._booked_uids:
            return None, f"in pod {uid}, container {cid[:12]} not (yet) in the pod's status", True
        if listed is None:
            return None, f"in pod {uid}, which holds no qgpu share", False
        key, listed_uid = listed
        if listed_uid != uid:
            return None, f"container {cid[:12]} is listed under another pod than its cgroup's {uid}", False
        return key, "", False

    def _in_container(self, pid: int, container: tuple[str, str] | None) -> bool:
        cgroup = self._proc.cgroup(pid)
        return cgroup is not None and pod_and_container(cgroup) == container

    def pids(self, key: str) -> list[int]:
        return sorted(pid for pid, seen in self._pids.items() if seen.key == key)

    def groups(self, key: str) -> list[int]:
        """Process groups of the container's GPU processes (what SIGSTOP/SIGCONT are sent to),
        checked now: reused PIDs are dropped, and a group holding any process that is not the
        container's is left out (logged)."""
        groups: dict[int, tuple[str, str] | None] = {}
        for pid in self.pids(key):
            seen = self._pids[pid]
            stat = self._proc.stat(pid)
            if stat is None or stat.start_ticks != seen.start_ticks or not self._in_container(pid, seen.container):
                log.info("PID %d of %s ended or now names another process: no longer signalled", pid, key)
                del self._pids[pid]
                continue
            groups[stat.pgid] = seen.container
        safe = []
        for pgid, container in sorted(groups.items()):
            foreign = self._outsiders(pgid, container)
            if foreign:
                seen = (pgid, tuple(foreign))
                if seen not in self._outsiders_logged:  # asked every tick while the workload is held
                    if len(self._outsiders_logged) >= 1024:
                        self._outsiders_logged.clear()
                    self._outsiders_logged.add(seen)
                    log.warning("process group %d of %s also holds process(es) %s outside the container: not signalled",
                                pgid, key, ", ".join(map(str, foreign)))
                continue
            safe.append(pgid)
        return safe

    def _outsiders(self, pgid: int, container: tuple[str, str] | None) -> list[int]:
        """The members of ``pgid`` that are alive and not shown to be in ``container``.

        The cgroup is read before the process is looked up again: a member that ended after the
        scan (a shell's short-lived child) reads no cgroup, or the root's once in exit(), and is
        then found gone, a zombie or exiting, and ignored; taken for a stranger, it would make its
        group skip a hold that is sent only once. A
        member that is alive but whose cgroup or stat cannot be read is a stranger: nothing
        vouches for it."""
        outsiders = []
        now = self._clock()
        if self._group_index is None or not 0 <= now - self._group_index_at <= GROUP_INDEX_S:
            self._group_index, self._group_index_at = self._proc.group_index(), now
        groups, unreadable = self._group_index
        for member in sorted([*groups.get(pgid, ()), *unreadable]):
            if self._in_container(member, container):
                continue
            if self._proc.ended(member):
                continue
            outsiders.append(member)
        return outsiders

    # -- /proc reading --------------------------------------------------------------------------
    def _alive(self, pid: int) -> bool:
        return (self.proc_root / str(pid)).is_dir()
