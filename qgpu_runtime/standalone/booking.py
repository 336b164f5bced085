"""Booking a standalone job on the host's cards, with the cluster's own parser and placement engine.

A `qgpu run` request is written as the qGPU pod it would be in a cluster and goes through
:func:`parse_pod`, so the rules (shared core below 100 needs memory, online jobs reserve memory
only, ...) and their messages are the cluster's. The host becomes a one-node ClusterState, the
live jobs are committed into it, and :func:`placement.place` chooses the card: the same engine
the scheduler extender and the simulator use.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from qgpu_runtime.contract.names import ISOLATION_POLICY_LABEL, MIXED_LABEL
from qgpu_runtime.model import AppClass, PodRequest, RequestError, parse_pod
from qgpu_runtime.model.requests import DEFAULT_LIMITS, QGPU_APP_CLASS, QGPU_CORE, QGPU_CORE_GREEDY, QGPU_MEMORY, CardLimits
from qgpu_runtime.placement import CardShare, CardSpec, ClusterState, ContainerPlacement, NodeSpec, Placement, Unschedulable, make_policy, place
from qgpu_runtime.standalone.config import HostConfig
from qgpu_runtime.standalone.store import JobRecord, JobShare, Store, StoredCard

NAMESPACE = "standalone"
CONTAINER = "job"
# a standalone host books GPUs only: CPU and memory are left to the operating system
_UNBOUNDED = 1 << 40

_FLAG_OF = {QGPU_CORE: "--core", QGPU_CORE_GREEDY: "--core", QGPU_MEMORY: "--memory", f"annotation {QGPU_APP_CLASS}": "--class"}


class JobRequestError(ValueError):
    """A `qgpu run` request breaks a rule; the message names the flag, the value and the rule."""


class NeverFits(Exception):
    """No card of this host could hold the job even with every card free: two cards on a
    one-card host, more memory than any card has. Waiting cannot help, unlike
    :class:`placement.Unschedulable`, which only says the job does not fit now."""

    def __init__(self, reasons: dict[str, str], cards: list[StoredCard]):
        self.reasons = reasons
        held = ", ".join(f"card {c.index} {c.model} {c.memory_mib} MiB" for c in cards) or "no cards"
        why = "; ".join(reasons.values())
        super().__init__(f"{why} even with every card free (this host has {held})")


@dataclass(frozen=True)
class JobSpec:
    name: str
    core_pct: int | None
    memory_gib: int | None
    klass: AppClass = AppClass.NORMAL
    limits: CardLimits = DEFAULT_LIMITS  # the cluster's parser's (--largest-card-memory-mib)


def job_request(spec: JobSpec) -> PodRequest:
    """The canonical request for a job, via the qGPU dialect parser."""
    limits: dict[str, str] = {}
    if spec.core_pct is not None:
        limits[QGPU_CORE_GREEDY if spec.klass is AppClass.OFFLINE else QGPU_CORE] = str(spec.core_pct)
    if spec.memory_gib is not None:
        limits[QGPU_MEMORY] = str(spec.memory_gib)
    if not limits:
        raise JobRequestError("--core/--memory: missing: a job asks for at least --memory (online) or --core")
    annotations = {} if spec.klass is AppClass.NORMAL else {QGPU_APP_CLASS: spec.klass.value}
    pod = {
        "metadata": {"namespace": NAMESPACE, "name": spec.name, "annotations": annotations},
        "spec": {"containers": [{"name": CONTAINER, "resources": {"limits": limits}}]},
    }
    try:
        request = parse_pod(pod, spec.limits)
    except RequestError as err:
        raise JobRequestError("; ".join(
            f"{_FLAG_OF.get(p.resource, p.resource)} {p.value}: {p.rule}" for p in err.problems)) from err
    if not request.wants_gpu:
        # a pod may ask for no GPU; a job books nothing then, and nothing would hold it to a card
        given = " ".join(f"{flag} {value}" for flag, value in (("--core", spec.core_pct), ("--memory", spec.memory_gib))
                         if value is not None)
        raise JobRequestError(f"{given} --class {spec.klass.value}: asks for no GPU: a job needs --core above 0, "
                              "or --memory above 0 (online jobs book memory only)")
    return request


def host_state(config: HostConfig, cards: list[StoredCard], jobs: list[JobRecord]) -> ClusterState:
    node = NodeSpec(
        name=config.node_name, cpu_milli=_UNBOUNDED, memory_mib=_UNBOUNDED,
        cards=tuple(CardSpec(c.index, c.uuid, c.model, c.memory_mib) for c in cards),
        labels={ISOLATION_POLICY_LABEL: config.policy.value, MIXED_LABEL: "enable"},
    )
    state = ClusterState([node])
    for job in jobs:
        state.commit(job.id, placement_of(config.node_name, job))
    return state


def placement_of(node: str, job: JobRecord) -> Placement:
    shares = tuple(CardShare(s.index, s.uuid, s.core_milli, s.memory_mib) for s in job.shares)
    return Placement(node, (ContainerPlacement(CONTAINER, shares, job.exclusive),), AppClass(job.klass))


def new_job_id(name: str) -> str:
    return f"{name}-{secrets.token_hex(3)}"


def ensure_ever_fits(config: HostConfig, cards: list[StoredCard], request: PodRequest) -> None:
    """Raise :class:`NeverFits` when the host's cards could not take ``request`` even if no job
    held any of them: the same engine, asked about capacity instead of current use."""
    try:
        place(host_state(config, cards, []), request, make_policy(config.placement))
    except Unschedulable as err:
        raise NeverFits(err.reasons, cards) from err


def try_book(store: Store, config: HostConfig, spec: JobSpec, job_id: str, command: str,
             supervisor_pid: int, supervisor_start: int, created: float) -> JobRecord:
    """Book the job in one write transaction, or raise :class:`placement.Unschedulable` (not now)
    or :class:`NeverFits` (not on this host, ever)."""
    request = job_request(spec)
    with store.transaction():
        store.reap()
        cards = store.cards()
        state = host_state(config, cards, store.booked_jobs())
        policy = make_policy(config.placement)
        try:
            placement = place(state, request, policy)
        except Unschedulable:
            ensure_ever_fits(config, cards, request)
            raise
        container = placement.containers[0]
        job = JobRecord(
            id=job_id, name=spec.name, klass=request.klass.value,
            core_milli=request.containers[0].core_milli, memory_mib=request.containers[0].memory_mib,
            shares=tuple(JobShare(s.index, s.uuid, s.core_milli, s.memory_mib) for s in container.shares),
            command=command, created=created, supervisor_pid=supervisor_pid, supervisor_start=supervisor_start,
            exclusive=container.exclusive,
        )
        store.insert_job(job)
        return job
