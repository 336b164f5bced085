"""Shares booked through DRA are enforced like the device plugin's: one isolation engine, two doors.

The DRA kubelet plugin's own preparer (node/dra/plugin.py) books each ResourceClaim — with the
class of its opaque ShareConfig and the pods of its ``status.reservedFor`` — in a real store; the
node's isolation loop (node/enforcer.py) runs over a fake /proc with each process's cgroup,
simulated cards with contention physics, and a kernel stand-in that turns process-group signals
into suspend/resume/exit of simulated processes (as in test_node_isolation.py). Pods reference
their claims the way the API writes them: ``containers[].resources.claims[].name`` →
``spec.resourceClaims[].name`` → ``resourceClaimName``, or for a template the claim named in
``status.resourceClaimStatuses``.
"""

from __future__ import annotations

import json
import signal
import sys
import uuid as uuidlib
from pathlib import Path

import pytest
from podfactory import pod as dp_pod
from podfactory import write_pods

from qgpu_runtime.contract import draclaim
from qgpu_runtime.contract.dra import DRIVER, SHARED_CLASS
from qgpu_runtime.contract.names import MIXED_LABEL
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.isolation.signals import SignalActuator
from qgpu_runtime.isolation.simbackend import SimProcessSampler
from qgpu_runtime.node.containers import TERMINATING_UNHELD_S, ContainerResolver
from qgpu_runtime.node.dra.preparer import ClaimPreparer
from qgpu_runtime.node.dra.settings import DraSettings
from qgpu_runtime.node.enforcer import NodeIsolation
from qgpu_runtime.node.metrics import ManagerMetrics
from qgpu_runtime.node.pods import FilePodSource
from qgpu_runtime.node.store import Grant, Share, Store

sys.path.insert(0, str(Path(__file__).parents[1] / "isolation"))
from helpers import make_backend  # noqa: E402  (tests/isolation/helpers.py)
from simnode import FakeProc, SimKernel, cgroupfs, cid_of, systemd  # noqa: E402

NODE = "gpu-node-1"
NS = "team-a"
TICK = 0.05
RESOURCE = "tke.cloud.tencent.com/qgpu-core"


class Claims:
    """The apiserver's ResourceClaims by (namespace, name)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {}

    def resource_claim(self, namespace: str, name: str) -> dict:
        return self.objects[(namespace, name)]


class DraWorld:
    """A node serving both doors: the DRA preparer and device-plugin rows in one store, one loop."""

    def __init__(self, tmp: Path, policy: Policy, cards: int = 1, memory_mib: int = 16384) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp
        self.policy = policy
        self.gpus = make_backend(cards=cards, memory_mib=memory_mib).gpus
        self.cards = {i: CardInfo(i, g.uuid, "SIM", memory_mib, i) for i, g in self.gpus.items()}
        self.proc = FakeProc(tmp / "proc")
        self.kernel = SimKernel(self.proc, self.gpus)
        self.pods_file = tmp / "pods.json"
        self.source = FilePodSource(self.pods_file)
        self.pods: list[dict] = []
        write_pods(self.pods_file, [])
        self.claims = Claims()
        self.now = 0.0
        self.open()

    def open(self) -> None:
        """Store, preparer and loop, as a (re)started manager builds them over the same files."""
        self.store = Store(self.tmp / "meta.db")
        self.store.sync_cards(list(self.cards.values()))
        self.preparer = ClaimPreparer(DraSettings(NODE, cdi_dir=self.tmp / "cdi"), self.cards, self.store, self.claims,
                                      lambda: self.policy.value, device_exists=lambda path: False,
                                      node_labels=lambda: {MIXED_LABEL: "enable"})
        self.metrics = ManagerMetrics.create(NODE)

        def backend(resolver: ContainerResolver):
            return SimProcessSampler(self.gpus, resolver.owner), SignalActuator(resolver.groups, killpg=self.kernel.killpg)

        self.loop = NodeIsolation(self.policy, self.store, lambda max_age: self.source.pods_on_node(NODE),
                                  ContainerResolver(self.proc.root, clock=lambda: self.now), backend, self.metrics, self.source,
                                  tick_s=TICK, refresh_s=TICK)

    def restart(self) -> None:
        self.loop.close()
        self.store.close()
        self.open()

    # -- the apiserver's objects ----------------------------------------------------------------
    def claim(self, name: str, core: int, memory_mib: int = 0, card: int = 0, klass: str | None = None,
              reserved_for: list[dict] | None = None) -> str:
        """An allocated ResourceClaim on ``card`` with an opaque ShareConfig when ``klass`` is given,
        prepared by the plugin; returns its UID."""
        uid = str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"claim/{NS}/{name}"))
        obj = {"metadata": {"namespace": NS, "name": name, "uid": uid},
               "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": SHARED_CLASS}}]}},
               "status": {"allocation": {"devices": {"results": [
                   {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": f"gpu-{card}",
                    "consumedCapacity": {"core": str(core), "memory": str(max(memory_mib, 1024)), "pods": "1"}}]}},
                   "reservedFor": reserved_for or []}}
        if klass is not None:
            obj["spec"]["devices"]["config"] = [{"requests": ["gpu"], "opaque": {
                "driver": DRIVER, "parameters": draclaim.share_config(klass, greedy=klass == "offline")}}]
        self.claims.objects[(NS, name)] = obj
        self.preparer.prepare(NS, uid, name)
        return uid

    def pod(self, name: str, containers: dict[str, list[str]], *, templated: bool = False, statuses: bool = True) -> tuple[dict, dict[str, str]]:
        """A running pod whose containers reference pod claims by entry name; entry ``e`` stands for
        the claim named ``e``: directly (``resourceClaimName``) or, ``templated``, through the
        pod's ``status.resourceClaimStatuses`` (omitted with ``statuses=False``). Returns the pod
        and its container IDs."""
        entries = sorted({e for refs in containers.values() for e in refs})
        ids = {c: cid_of(len(self.pods) * 8 + i + 1) for i, c in enumerate(containers)}
        spec_claims = [{"name": e, "resourceClaimTemplateName": "t"} if templated else {"name": e, "resourceClaimName": e}
                       for e in entries]
        status = {"phase": "Running", "containerStatuses": [{"name": c, "containerID": f"containerd://{cid}"} for c, cid in ids.items()]}
        if templated and statuses:
            status["resourceClaimStatuses"] = [{"name": e, "resourceClaimName": e} for e in entries]
        p = {"metadata": {"name": name, "namespace": NS, "uid": str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"pod/{NS}/{name}"))},
             "spec": {"nodeName": NODE, "resourceClaims": spec_claims,
                      "containers": [{"name": c, "resources": {"claims": [{"name": e} for e in refs]}} for c, refs in containers.items()]},
             "status": status}
        self.pods.append(p)
        write_pods(self.pods_file, self.pods)
        return p, ids

    def dp_pod(self, name: str, core: int, memory_mib: int = 0, klass: str = "normal", card: int = 0) -> tuple[str, str]:
        """A pod whose share the device plugin booked (as test_node_isolation.py books them)."""
        cid = cid_of(len(self.pods) * 8 + 1)
        p = dp_pod(name, NODE, [("main", {RESOURCE: str(core // 10)}, [(card, self.gpus[card].uuid, core, memory_mib)])],
                   namespace=NS, klass=klass, phase="Running", container_ids={"main": cid})
        uid = p["metadata"]["uid"]
        self.pods.append(p)
        write_pods(self.pods_file, self.pods)
        self.store.record(Grant(uid, NS, name, "main", RESOURCE, (f"core-{card}-0",), 1),
                          [Share(uid, NS, name, "main", card, self.gpus[card].uuid, core, memory_mib, klass, 1)])
        return uid, cid

    def remove_pod(self, p: dict) -> None:
        self.pods.remove(p)
        write_pods(self.pods_file, self.pods)

    # -- the node's processes -------------------------------------------------------------------
    def run(self, pid: int, cgroup: str, demand_milli: float, card: int = 0, memory_mib: int = 0) -> None:
        self.proc.add(pid, cgroup, pid)
        self.gpus[card].spawn(pid, demand_milli, memory_mib)

    def drive(self, seconds: float, events: dict | None = None, observe=None) -> None:
        for n in range(round(seconds / TICK)):
            if events and n in events:
                events[n]()
            for gpu in self.gpus.values():
                gpu.advance(TICK)
            self.now += TICK
            report = self.loop.tick(TICK, self.now)
            if observe is not None:
                observe(self.now, report)

    def used(self, pid: int, card: int = 0) -> float:
        return self.gpus[card].processes[pid].used_total

    def rate(self, pid: int, seconds: float) -> float:
        """Milli of the card ``pid`` used over the next ``seconds``."""
        before = self.used(pid)
        self.drive(seconds)
        return (self.used(pid) - before) / seconds


@pytest.fixture
def world_of(tmp_path):
    made: list[DraWorld] = []

    def make(policy: Policy, **kw) -> DraWorld:
        w = DraWorld(tmp_path / str(len(made)), policy, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.loop.close()
        w.store.close()


def _uid(p: dict) -> str:
    return p["metadata"]["uid"]


def _two_pods_sharing_a_claim(w: DraWorld, core: int = 300, memory_mib: int = 0, demand_milli: float = 1000,
                              process_mib: int = 0) -> tuple[dict, dict]:
    """Claim ``shared`` and pods ``one`` and ``two`` whose ``main`` containers both reference it,
    each running one process on card 0 (101 in ``one``, 202 in ``two``); returns the two pods."""
    w.claim("shared", core, memory_mib=memory_mib)
    p1, i1 = w.pod("one", {"main": ["shared"]})
    p2, i2 = w.pod("two", {"main": ["shared"]})
    w.run(101, cgroupfs(_uid(p1), i1["main"]), demand_milli, memory_mib=process_mib)
    w.run(202, cgroupfs(_uid(p2), i2["main"]), demand_milli, memory_mib=process_mib)
    return p1, p2


# ---- one engine, whichever door booked ---------------------------------------------------------
@pytest.mark.parametrize("policy", [Policy.FIXED_SHARE, Policy.BURST_SHARE])
def test_a_claims_share_is_held_to_it_beside_a_device_plugin_share(world_of, policy):
    w = world_of(policy)
    w.claim("infer", 400)
    p, ids = w.pod("infer", {"main": ["infer"]})
    uid_dp, cid_dp = w.dp_pod("train", 600)
    w.run(101, cgroupfs(_uid(p), ids["main"]), 1000)
    w.run(202, systemd(uid_dp, cid_dp), 1000)
    w.drive(2.0)
    assert w.rate(101, 8.0) == pytest.approx(400, abs=20)
    assert w.used(202) / 10.0 == pytest.approx(600, abs=20)
    assert w.kernel.signalled(101).count(signal.SIGSTOP) > 10  # duty cycling through its process group


def test_fixed_share_caps_a_lone_claim_on_an_idle_card(world_of):
    w = world_of(Policy.FIXED_SHARE)
    w.claim("alone", 250)
    p, ids = w.pod("alone", {"main": ["alone"]})
    w.run(101, systemd(_uid(p), ids["main"]), 1000)
    w.drive(10.0)
    assert w.used(101) / 10.0 == pytest.approx(250, abs=15)


def test_a_claims_memory_is_capped_and_the_event_goes_to_its_pod(world_of):
    w = world_of(Policy.BEST_EFFORT)
    w.claim("greedy", 500, memory_mib=2048)
    w.claim("polite", 500, memory_mib=2048)
    pg, ig = w.pod("greedy", {"main": ["greedy"]})
    pp, ip = w.pod("polite", {"main": ["polite"]})
    w.run(101, cgroupfs(_uid(pg), ig["main"]), 500, memory_mib=1024)
    w.run(202, cgroupfs(_uid(pp), ip["main"]), 500, memory_mib=1024)
    w.drive(0.5, events={3: lambda: w.gpus[0].allocate(101, 2048)})
    assert w.kernel.signalled(101) == [signal.SIGCONT, signal.SIGTERM]
    assert 101 not in w.gpus[0].processes and 202 in w.gpus[0].processes
    events = [json.loads(line) for line in w.pods_file.with_suffix(".events.jsonl").read_text().splitlines()]
    assert [(e["namespace"], e["pod"], e["uid"], e["reason"]) for e in events] == [(NS, "greedy", _uid(pg), "GPUMemoryQuotaExceeded")]


def test_an_offline_claim_yields_to_a_busy_online_claim_and_resumes_after(world_of):
    w = world_of(Policy.FIXED_SHARE)
    w.claim("batch", 500, klass="offline")
    w.claim("web", 10, memory_mib=1024, klass="online")
    pb, ib = w.pod("batch", {"main": ["batch"]})
    po, io = w.pod("web", {"main": ["web"]})
    # online work books memory only, as through the device plugin: never capped at the 10 it asked
    assert {s.workload: (s.klass, s.core_milli) for s in w.store.shares()} == {"batch": ("offline", 500), "web": ("online", 0)}
    w.run(101, cgroupfs(_uid(pb), ib["main"]), 1000)
    w.run(202, cgroupfs(_uid(po), io["main"]), 0)
    assert w.rate(101, 2.0) == pytest.approx(500, abs=25)  # alone, it gets its share

    held_at: list[float] = []
    busy_at = w.now + TICK

    def observe(t, report):
        if not held_at and f"{NS}/batch/main" in report.held:
            held_at.append(t)

    w.drive(3.0, events={0: lambda: w.gpus[0].set_demand(202, 1000)}, observe=observe)
    assert held_at and held_at[0] - busy_at <= 2 * TICK + 1e-9
    assert w.gpus[0].processes[101].suspended_at is not None
    w.gpus[0].set_demand(202, 0)
    assert w.rate(101, 3.0) > 300  # back to (most of) its share after the hysteresis


def test_an_offline_claim_yields_to_a_busy_device_plugin_pod_too(world_of):
    w = world_of(Policy.BEST_EFFORT)
    w.claim("batch", 500, klass="offline")
    pb, ib = w.pod("batch", {"main": ["batch"]})
    uid_dp, cid_dp = w.dp_pod("web", 300)
    w.run(101, cgroupfs(_uid(pb), ib["main"]), 1000)
    w.run(202, cgroupfs(uid_dp, cid_dp), 1000)
    w.drive(1.0)
    assert w.rate(101, 3.0) < 20 and w.used(202) > 2500


# ---- claims, pods and containers in every combination ------------------------------------------
def test_a_claim_shared_by_two_containers_is_one_tenant_held_to_the_claims_share(world_of):
    w = world_of(Policy.FIXED_SHARE)
    w.claim("shared", 300)
    p, ids = w.pod("duo", {"a": ["shared"], "b": ["shared"]})
    w.run(101, cgroupfs(_uid(p), ids["a"]), 1000)
    w.run(202, cgroupfs(_uid(p), ids["b"]), 1000)
    w.drive(2.0)
    a, b = w.used(101), w.used(202)
    w.drive(8.0)
    assert (w.used(101) - a + w.used(202) - b) / 8.0 == pytest.approx(300, abs=20)  # 300 together, not 300 each
    assert {wl.key for wl in w.loop._workloads} == {f"{NS}/duo/a+{NS}/duo/b"}


def test_a_claim_shared_by_two_pods_is_one_tenant(world_of):
    w = world_of(Policy.FIXED_SHARE)
    _two_pods_sharing_a_claim(w)
    w.drive(2.0)
    a, b = w.used(101), w.used(202)
    w.drive(8.0)
    assert (w.used(101) - a + w.used(202) - b) / 8.0 == pytest.approx(300, abs=20)


def test_a_claim_shared_by_two_pods_is_left_unheld_only_once_both_are_being_deleted_and_from_the_first(world_of):
    w = world_of(Policy.FIXED_SHARE)
    p1, p2 = _two_pods_sharing_a_claim(w)
    w.drive(1.0)
    [key] = [wl.key for wl in w.loop._workloads]
    held: list[float] = []

    def note(t, report):
        if key in report.held:
            held.append(t)

    p1["metadata"]["deletionTimestamp"] = "2099-01-01T00:00:00Z"
    write_pods(w.pods_file, w.pods)
    first_seen = w.now + TICK
    w.drive(5.0, observe=note)
    assert held  # one member's deletion does not let the other run unheld
    p2["metadata"]["deletionTimestamp"] = "2099-01-01T00:00:00Z"
    write_pods(w.pods_file, w.pods)
    held.clear()
    w.drive(first_seen + TERMINATING_UNHELD_S - w.now - TICK, observe=note)
    assert held == []  # both are being deleted: unheld, until the window of the first ends
    w.drive(2.0, observe=note)
    assert held  # the window was counted from the first deletion, not the last


def test_a_container_with_two_claims_on_one_card_gets_their_sum(world_of):
    w = world_of(Policy.FIXED_SHARE)
    w.claim("first", 200)
    w.claim("second", 300)
    p, ids = w.pod("both", {"main": ["first", "second"], "idle": []})
    w.run(101, cgroupfs(_uid(p), ids["main"]), 1000)
    w.drive(2.0)
    assert w.rate(101, 8.0) == pytest.approx(500, abs=20)


def test_containers_of_one_pod_with_their_own_claims_are_their_own_tenants(world_of):
    w = world_of(Policy.FIXED_SHARE)
    w.claim("small", 200)
    w.claim("large", 600)
    p, ids = w.pod("pair", {"a": ["small"], "b": ["large"]})
    w.run(101, cgroupfs(_uid(p), ids["a"]), 1000)
    w.run(202, cgroupfs(_uid(p), ids["b"]), 1000)
    w.drive(2.0)
    a, b = w.used(101), w.used(202)
    w.drive(8.0)
    assert (w.used(101) - a) / 8.0 == pytest.approx(200, abs=20)
    assert (w.used(202) - b) / 8.0 == pytest.approx(600, abs=20)


def test_a_templated_claim_is_found_through_the_pods_claim_statuses(world_of):
    w = world_of(Policy.FIXED_SHARE)
    w.claim("tpl-0", 300)
    p, ids = w.pod("templated", {"main": ["tpl-0"]}, templated=True)
    w.run(101, cgroupfs(_uid(p), ids["main"]), 1000)
    w.drive(2.0)
    assert w.rate(101, 8.0) == pytest.approx(300, abs=20)


def test_a_claim_reserved_for_a_pod_that_is_gone_is_let_go_and_stays_booked_until_unprepared(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid = w.claim("gone", 300)
    p, ids = w.pod("gone", {"main": ["gone"]})
    w.run(101, cgroupfs(_uid(p), ids["main"]), 1000)
    w.drive(2.0)
    assert w.kernel.signalled(101).count(signal.SIGSTOP) > 5
    w.remove_pod(p)  # deleted; its process lingers on the card a moment
    w.drive(1.0)
    assert w.gpus[0].processes[101].suspended_at is None and w.kernel.signalled(101)[-1] == signal.SIGCONT
    assert w.loop._workloads == [] and [s.workload_id for s in w.store.shares()] == [uid]  # counted until kubelet unprepares
    w.preparer.unprepare(NS, uid, "gone")
    assert w.store.shares() == [] and w.store.prepared_claims() == []


# ---- a restarted manager: state from the store ------------------------------------------------
def test_a_restarted_manager_enforces_a_claim_from_the_store_and_its_reserved_pods(world_of):
    """The pod's claim status is not written (templated, statuses lost): only the reservedFor pod
    recorded at prepare links it to the claim, and the restarted loop reads that from the store."""
    w = world_of(Policy.FIXED_SHARE)
    p, ids = w.pod("restarted", {"main": ["tpl"]}, templated=True, statuses=False)
    w.claim("tpl-x", 300, klass="normal",
            reserved_for=[{"resource": "pods", "name": "restarted", "uid": _uid(p)}])
    w.run(101, cgroupfs(_uid(p), ids["main"]), 1000)
    w.drive(2.0)
    assert w.rate(101, 4.0) == pytest.approx(300, abs=25)
    w.restart()
    assert w.gpus[0].processes[101].suspended_at is None  # the old loop resumed it on close
    assert [pod.uid for pod in w.store.prepared_claims()[0].pods] == [_uid(p)]
    w.drive(1.0)
    assert w.rate(101, 4.0) == pytest.approx(300, abs=25)


def test_a_claim_shared_by_two_pods_over_its_memory_stops_both_and_reports_on_one_named_pod(world_of):
    w = world_of(Policy.BEST_EFFORT)
    p1, _ = _two_pods_sharing_a_claim(w, 500, memory_mib=2048, demand_milli=300, process_mib=1024)
    w.drive(0.5, events={3: lambda: w.gpus[0].allocate(202, 1024)})  # together over the claim's 2048 MiB
    assert 101 not in w.gpus[0].processes and 202 not in w.gpus[0].processes
    events = [json.loads(line) for line in w.pods_file.with_suffix(".events.jsonl").read_text().splitlines()]
    assert [(e["pod"], e["uid"], e["reason"]) for e in events] == [("one", _uid(p1), "GPUMemoryQuotaExceeded")]


# ---- a pod past the entries qgpu keeps of one (kube/podslim.py) -------------------------------
def test_a_pod_past_the_entries_budget_is_held_to_its_claims_share_on_all_of_its_containers(world_of):
    """Kept oversized, the pod has no containers, claims or statuses to link the claim's rows to a
    process: 600 bare containers beside the one using the claim would have left its share
    unenforced. The claim reserved for it links the whole pod (node/tenants.py WHOLE_POD), and each
    of its processes is attributed by its cgroup's pod UID."""
    from qgpu_runtime.kube.podslim import kept, oversized

    w = world_of(Policy.FIXED_SHARE)
    p, ids = w.pod("wide", {"main": ["wide"]})
    p["spec"]["containers"] += [{"name": f"w{i}", "image": "busybox"} for i in range(600)]
    write_pods(w.pods_file, w.pods)
    assert oversized(p) is not None
    w.claim("wide", 250, reserved_for=[{"resource": "pods", "name": "wide", "uid": _uid(p)}])
    w.run(101, cgroupfs(_uid(p), ids["main"]), 1000)
    w.run(102, systemd(_uid(p), cid_of(999)), 1000, card=0)  # another container of it, no status kept
    w.loop.resolver.update([kept(p)], w.store.shares(), w.store.prepared_claims())  # as the manager keeps it
    assert w.loop.resolver.owner(101) == w.loop.resolver.owner(102) == f"{NS}/wide/*"
    w.drive(10.0)
    assert (w.used(101) + w.used(102)) / 10.0 == pytest.approx(250, abs=20)
