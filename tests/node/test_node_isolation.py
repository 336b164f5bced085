"""The node manager's isolation loop on containers: fake /proc, simulated cards, a real store.

The world around the loop is modelled, never stubbed: a proc root with each process's cgroup
(cgroupfs and systemd layouts) and stat (process group), simulated GPUs with contention physics
running those processes, and a kernel stand-in that turns SIGSTOP/SIGCONT/SIGTERM/SIGKILL of a
process group into suspend/resume/exit of its simulated processes (signalling made-up groups on
the test host could hit real processes). The loop under test is the production one: cgroup →
pod UID + container ID → pod status → store shares → isolation engine → SignalActuator.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
from podfactory import pod, write_pods
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qgpu_runtime.gpu.simulated import SimulatedBackend, build_cards, parse_spec
from qgpu_runtime.isolation.policy import POLICY_LABEL, Policy
from qgpu_runtime.isolation.procfs import ProcFS
from qgpu_runtime.isolation.signals import SignalActuator
from qgpu_runtime.isolation.simbackend import SimProcessSampler
from qgpu_runtime.node.containers import TERMINATING_UNHELD_S, ContainerResolver
from qgpu_runtime.node.deviceplugin.resources import parse_resources
from qgpu_runtime.node.enforcer import NodeIsolation, resolve_policy
from qgpu_runtime.node.manager import ManagerConfig, NodeManager
from qgpu_runtime.node.metrics import ManagerMetrics
from qgpu_runtime.node.pods import FilePodSource
from qgpu_runtime.node.store import Grant, Share, Store
from tests.recordkeys import VERIFIER

sys.path.insert(0, str(Path(__file__).parents[1] / "isolation"))
from helpers import make_backend  # noqa: E402  (tests/isolation/helpers.py)
from simnode import AdvancingSampler, FakeProc, SimKernel, cgroupfs, cid_of, systemd  # noqa: E402

NODE = "gpu-node-1"
TICK = 0.05
RESOURCE = "tke.cloud.tencent.com/qgpu-core"


class World:
    """A node: cards, a proc root, pods in a file, a store with shares, and the isolation loop."""

    def __init__(self, tmp: Path, policy: Policy, cards: int = 1, memory_mib: int = 16384, tolerance_mib: int = 0,
                 wrap_sampler=lambda sampler: sampler) -> None:
        self.gpus = make_backend(cards=cards, memory_mib=memory_mib).gpus
        self.proc = FakeProc(tmp / "proc")
        self.kernel = SimKernel(self.proc, self.gpus)
        self.store = Store(tmp / "meta.db")
        self.pods_file = tmp / "pods.json"
        self.source = FilePodSource(self.pods_file)
        self.pods: list[dict] = []
        write_pods(self.pods_file, [])
        self.metrics = ManagerMetrics.create(NODE)
        self.now = 0.0  # the manager's monotonic clock: the loop's, the actuator's grace periods, the resolver's

        def backend(resolver: ContainerResolver):
            return (wrap_sampler(SimProcessSampler(self.gpus, resolver.owner)),
                    SignalActuator(resolver.groups, killpg=self.kernel.killpg, clock=lambda: self.now,
                                   running=resolver.running))  # as node/enforcer.py wires it

        self.loop = NodeIsolation(policy, self.store, lambda max_age: self.source.pods_on_node(NODE),
                                  ContainerResolver(self.proc.root, clock=lambda: self.now), backend, self.metrics, self.source,
                                  tick_s=TICK, refresh_s=TICK, memory_tolerance_mib=tolerance_mib)

    def add_pod(self, name: str, core: int, memory_mib: int = 0, klass: str = "normal", card: int = 0,
                book: bool = True) -> tuple[str, str]:
        """A running pod with one container ``main``; with ``book`` its share is in the store."""
        cid = cid_of(len(self.pods) + 1)
        p = pod(name, NODE, [("main", {RESOURCE: str(core // 10)}, [(card, self.gpus[card].uuid, core, memory_mib)])],
                klass=klass, phase="Running", container_ids={"main": cid})
        uid = p["metadata"]["uid"]
        self.pods.append(p)
        write_pods(self.pods_file, self.pods)
        if book:
            self.store.record(Grant(uid, "default", name, "main", RESOURCE, (f"core-{card}-0",), len(self.pods)),
                              [Share(uid, "default", name, "main", card, self.gpus[card].uuid, core, memory_mib, klass, len(self.pods))])
        return uid, cid

    def run_process(self, pid: int, cgroup: str, demand_milli: float, card: int = 0, memory_mib: int = 0, pgid: int | None = None) -> None:
        self.proc.add(pid, cgroup, pgid if pgid is not None else pid)
        self.gpus[card].spawn(pid, demand_milli, memory_mib)

    def drive(self, seconds: float, events: dict[int, callable] | None = None, observe=None) -> None:
        for n in range(round(seconds / TICK)):
            if events and n in events:
                events[n]()
            self.kernel.run_handlers()
            for gpu in self.gpus.values():
                gpu.advance(TICK)
            self.now += TICK
            report = self.loop.tick(TICK, self.now)
            if observe is not None:
                observe(self.now, report)

    def used(self, pid: int, card: int = 0) -> float:
        return self.gpus[card].processes[pid].used_total

    def samples(self) -> dict[tuple[str, frozenset], float]:
        text = generate_latest(self.metrics.registry).decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def world_of(tmp_path):
    made: list[World] = []

    def make(policy: Policy, **kw) -> World:
        w = World(tmp_path / str(len(made)), policy, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.store.close()


# ---- the policies, on containers ---------------------------------------------------------------
def test_fixed_share_caps_each_container_at_its_share_whatever_its_cgroup_layout(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid_a, cid_a = w.add_pod("a", 300)
    uid_b, cid_b = w.add_pod("b", 600)
    w.run_process(101, cgroupfs(uid_a, cid_a), 1000)
    w.run_process(202, systemd(uid_b, cid_b), 1000)
    w.drive(10.0)
    assert w.used(101) / 10.0 == pytest.approx(300, abs=15)
    assert w.used(202) / 10.0 == pytest.approx(600, abs=15)


def test_fixed_share_caps_a_lone_container_on_an_idle_card(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("alone", 250)
    w.run_process(101, cgroupfs(uid, cid), 1000)
    w.drive(10.0)
    assert w.used(101) / 10.0 == pytest.approx(250, abs=15)
    assert w.kernel.signalled(101).count(signal.SIGSTOP) > 10  # duty cycling through its process group


def test_burst_share_lends_idle_capacity_and_gives_it_back_when_the_owner_returns(world_of):
    w = world_of(Policy.BURST_SHARE)
    uid_a, cid_a = w.add_pod("borrower", 300)
    uid_b, cid_b = w.add_pod("owner", 700)
    w.run_process(101, cgroupfs(uid_a, cid_a), 1000)
    w.drive(3.0)
    assert w.used(101) / 3.0 > 950  # the owner is idle: its capacity is lent

    before = w.used(101)
    w.run_process(202, systemd(uid_b, cid_b), 1000)
    w.drive(1.0)  # fall-back window
    settled_a, settled_b = w.used(101), w.used(202)
    w.drive(6.0)
    assert (w.used(101) - settled_a) / 6.0 == pytest.approx(300, abs=20)
    assert (w.used(202) - settled_b) / 6.0 == pytest.approx(700, abs=20)
    assert w.used(101) - before < 1000 * 7.0  # it really was throttled after the owner came back


def test_offline_container_yields_when_online_work_gets_busy_and_resumes_after(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid_off, cid_off = w.add_pod("batch", 500, klass="offline")
    uid_on, cid_on = w.add_pod("web", 0, memory_mib=1024, klass="online")
    w.run_process(101, cgroupfs(uid_off, cid_off), 1000)
    w.run_process(202, cgroupfs(uid_on, cid_on), 0)
    w.drive(2.0)
    assert w.used(101) / 2.0 == pytest.approx(500, abs=25)  # alone, it gets its share

    held_at: list[float] = []
    online_busy_at = w.now + TICK

    def observe(t, report):
        if not held_at and "default/batch/main" in report.held:
            held_at.append(t)

    w.drive(3.0, events={0: lambda: w.gpus[0].set_demand(202, 1000)}, observe=observe)
    assert held_at and held_at[0] - online_busy_at <= 2 * TICK + 1e-9
    assert w.gpus[0].processes[101].suspended_at is not None

    online = w.used(202)
    w.drive(2.0)
    assert (w.used(202) - online) / 2.0 > 950  # the online container has the card

    w.gpus[0].set_demand(202, 0)
    batch = w.used(101)
    w.drive(3.0)
    assert (w.used(101) - batch) / 3.0 > 300  # back to (most of) its share after the hysteresis


def test_memory_over_quota_stops_the_container_and_says_why_in_three_places(world_of):
    w = world_of(Policy.BEST_EFFORT)
    uid_g, cid_g = w.add_pod("greedy", 500, memory_mib=2048)
    uid_p, cid_p = w.add_pod("polite", 500, memory_mib=2048)
    w.run_process(101, cgroupfs(uid_g, cid_g), 500, memory_mib=1024)
    w.run_process(202, systemd(uid_p, cid_p), 500, memory_mib=1024)
    w.drive(0.5, events={3: lambda: w.gpus[0].allocate(101, 2048)})

    assert w.kernel.signalled(101) == [signal.SIGCONT, signal.SIGTERM]  # continued first: a stopped process cannot exit
    assert 101 not in w.gpus[0].processes and 202 in w.gpus[0].processes
    assert w.kernel.signalled(202) == []
    events = [json.loads(line) for line in w.pods_file.with_suffix(".events.jsonl").read_text().splitlines()]
    assert [(e["namespace"], e["pod"], e["uid"], e["reason"]) for e in events] == [("default", "greedy", uid_g, "GPUMemoryQuotaExceeded")]
    assert "3072 MiB" in events[0]["message"] and "2048 MiB" in events[0]["message"]
    got = w.samples()
    assert got[("qgpu_memory_quota_violations_total", frozenset({"workload": "default/greedy/main", "card": "0"}.items()))] == 1


def test_memory_within_tolerance_is_left_alone(world_of):
    w = world_of(Policy.BEST_EFFORT, tolerance_mib=512)
    uid, cid = w.add_pod("ctx", 500, memory_mib=2048)
    w.run_process(101, cgroupfs(uid, cid), 500, memory_mib=2048 + 300)  # the CUDA context's few hundred MiB
    w.drive(0.5)
    assert w.kernel.sent == [] and 101 in w.gpus[0].processes


def test_processes_outside_qgpu_containers_are_never_signalled_and_logged_once(world_of, caplog):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("capped", 200)
    uid_foreign, cid_foreign = w.add_pod("foreign", 500, book=False)  # a pod another device plugin serves
    w.run_process(101, cgroupfs(uid, cid), 1000)
    w.run_process(303, "0::/user.slice/user-1000.slice/session-3.scope\n", 1000)  # a host process
    w.run_process(404, systemd(uid_foreign, cid_foreign), 1000)
    with caplog.at_level(logging.INFO, logger="qgpu.node.isolation"):
        w.drive(3.0)
    assert w.kernel.signalled(303) == [] and w.kernel.signalled(404) == []
    assert w.gpus[0].processes[303].suspended_at is None and w.gpus[0].processes[404].suspended_at is None
    assert w.kernel.signalled(101)  # the qgpu container on the same card is enforced
    logged = [r.getMessage() for r in caplog.records if "left alone" in r.getMessage()]
    assert sorted(m.split()[2] for m in logged) == ["303", "404"]
    assert "not in a Kubernetes pod" in next(m for m in logged if " 303 " in m)
    assert "holds no qgpu share" in next(m for m in logged if " 404 " in m)
    assert w.samples()[("qgpu_isolation_unmanaged_processes", frozenset({"node": NODE}.items()))] == 2


def test_a_container_with_processes_in_two_groups_is_charged_and_held_as_one(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("pair", 300)
    w.run_process(101, cgroupfs(uid, cid), 1000, pgid=101)
    w.run_process(102, cgroupfs(uid, cid), 1000, pgid=102)
    w.drive(10.0)
    assert (w.used(101) + w.used(102)) / 10.0 == pytest.approx(300, abs=15)
    assert w.kernel.signalled(101) == w.kernel.signalled(102) != []


def test_a_held_container_whose_pod_finished_is_resumed_and_left_alone(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("job", 100)
    w.run_process(101, cgroupfs(uid, cid), 1000)
    w.drive(0.2)
    assert w.loop.engine.held == {"default/job/main"}
    w.pods[0]["status"]["phase"] = "Succeeded"
    write_pods(w.pods_file, w.pods)
    w.drive(TICK)
    assert w.kernel.signalled(101)[-1] is signal.SIGCONT and w.gpus[0].processes[101].suspended_at is None
    sent = len(w.kernel.sent)
    w.drive(1.0)
    assert len(w.kernel.sent) == sent and not w.loop.engine.held


def delete_pod(w: World, index: int) -> None:
    """``kubectl delete pod`` of a pod whose owner set a year's ``terminationGracePeriodSeconds``;
    the ``deletionTimestamp`` (the apiserver's wall time) is far off, and is not believed."""
    w.pods[index]["metadata"]["deletionTimestamp"] = "2099-01-01T00:00:00Z"
    w.pods[index]["spec"]["terminationGracePeriodSeconds"] = 31536000
    write_pods(w.pods_file, w.pods)


def test_a_pod_being_deleted_is_resumed_left_unheld_for_a_bounded_window_then_held_to_its_share(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid_v, cid_v = w.add_pod("victim", 500)
    uid_l, cid_l = w.add_pod("leaver", 200)
    w.run_process(101, cgroupfs(uid_v, cid_v), 1000)
    w.run_process(202, cgroupfs(uid_l, cid_l), 1000)
    w.kernel.handlers[(202, signal.SIGTERM)] = lambda: None  # it traps SIGTERM and runs on
    w.drive(1.0)
    delete_pod(w, 1)
    held_in_window: list[float] = []
    w.drive(TERMINATING_UNHELD_S, observe=lambda t, r: "default/leaver/main" in r.held and held_in_window.append(t))
    assert held_in_window == [] and w.gpus[0].processes[202].suspended_at is None  # resumed, free to handle SIGTERM
    w.drive(6.0)  # the window is over: the debt it ran up (at most one card-second) is repaid
    leaver, victim = w.used(202), w.used(101)
    w.drive(10.0)
    assert (w.used(202) - leaver) / 10.0 == pytest.approx(200, abs=15)
    assert (w.used(101) - victim) / 10.0 == pytest.approx(500, abs=15)


def test_a_pod_being_deleted_is_stopped_over_its_memory_quota_at_once(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("leaver", 200, memory_mib=1024)
    w.run_process(202, cgroupfs(uid, cid), 1000)
    w.kernel.handlers[(202, signal.SIGTERM)] = lambda: None  # it traps SIGTERM and runs on
    w.drive(1.0)
    delete_pod(w, 0)
    w.drive(1.0)
    w.gpus[0].processes[202].memory_mib = 12288  # inside its unheld window
    w.drive(5.0 + 2 * TICK)  # the grace period of a stop, and the tick that reaps it
    assert 202 not in w.gpus[0].processes
    assert w.kernel.signalled(202)[-2:] == [signal.SIGTERM, signal.SIGKILL]
    assert w.samples()[("qgpu_memory_quota_violations_total", frozenset({"workload": "default/leaver/main", "card": "0"}.items()))] == 1


def test_closing_the_loop_resumes_every_held_container(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("a", 100)
    w.run_process(101, cgroupfs(uid, cid), 1000)
    w.drive(0.2)
    assert w.loop.engine.held == {"default/a/main"}
    w.loop.close()
    assert w.gpus[0].processes[101].suspended_at is None and w.kernel.signalled(101)[-1] is signal.SIGCONT


def test_metrics_show_policy_held_allowance_and_charged_use_per_container(world_of):
    w = world_of(Policy.BURST_SHARE)
    uid_a, cid_a = w.add_pod("a", 300)
    uid_b, cid_b = w.add_pod("b", 700)
    w.run_process(101, cgroupfs(uid_a, cid_a), 1000)
    w.run_process(202, cgroupfs(uid_b, cid_b), 1000)
    w.drive(2.0)
    got = w.samples()
    assert got[("qgpu_isolation_policy_info", frozenset({"node": NODE, "policy": "burst-share"}.items()))] == 1

    def labels(name, card=None):
        base = {"node": NODE, "namespace": "default", "pod": name, "container": "main"}
        return frozenset({**base, **({"card": card} if card else {})}.items())

    assert got[("qgpu_container_core_allowance_ratio", labels("a", "0"))] == pytest.approx(0.3)
    assert got[("qgpu_container_core_allowance_ratio", labels("b", "0"))] == pytest.approx(0.7)
    assert sorted([got[("qgpu_container_held", labels("a"))], got[("qgpu_container_held", labels("b"))]]) == [0, 1]
    assert 0 <= got[("qgpu_container_core_charged_ratio", labels("a", "0"))] <= 1
    assert got[("qgpu_isolation_holds_total", frozenset())] > 10


# ---- the policy: node label, override ---------------------------------------------------------
@pytest.mark.parametrize("value, policy", [("best-effort", Policy.BEST_EFFORT), ("be", Policy.BEST_EFFORT),
                                           ("fixed-share", Policy.FIXED_SHARE), ("fs", Policy.FIXED_SHARE),
                                           ("burst-share", Policy.BURST_SHARE), ("BS", Policy.BURST_SHARE)])
def test_policy_comes_from_the_node_label_in_long_or_short_form(value, policy):
    assert resolve_policy(None, {POLICY_LABEL: value}) is policy


def test_policy_defaults_to_best_effort_without_the_label():
    assert resolve_policy(None, {"other": "x"}) is Policy.BEST_EFFORT


def test_a_bad_label_value_is_an_error_naming_the_label_and_the_value():
    with pytest.raises(ValueError, match=rf"node label {POLICY_LABEL}: 'guaranteed' is not a known isolation policy"):
        resolve_policy(None, {POLICY_LABEL: "guaranteed"})


def test_the_flag_overrides_the_label_even_a_bad_one():
    assert resolve_policy("fs", {POLICY_LABEL: "burst-share"}) is Policy.FIXED_SHARE
    assert resolve_policy("burst-share", {POLICY_LABEL: "guaranteed"}) is Policy.BURST_SHARE
    with pytest.raises(ValueError, match=r"--isolation-policy: 'strict' is not a known isolation policy"):
        resolve_policy("strict", {})


# ---- the loop inside the real node manager -----------------------------------------------------
def manager_on(root: Path, label: str | None, override: str | None, gpus, kernel) -> NodeManager:
    pods_file = root / "pods.json"
    if not pods_file.exists():
        write_pods(pods_file, [])
    if label is not None:
        pods_file.with_suffix(".node.json").write_text(json.dumps({"metadata": {"name": NODE, "labels": {POLICY_LABEL: label}}}))
    config = ManagerConfig(node=NODE, resources=parse_resources(RESOURCE), plugin_dir=root / "dp",
                           pod_resources_socket=root / "pr.sock", state_dir=root / "state", isolation_policy=override,
                           sample_interval_s=0.2, pod_refresh_s=0.0, proc_root=root / "proc", isolation_refresh_s=0.1, record_verifier=VERIFIER)
    backend = SimulatedBackend(build_cards(parse_spec("1xT4-16G"), NODE), None)
    return NodeManager(config, backend, Store(root / "meta.db"), FilePodSource(pods_file),
                       isolation=lambda r: (AdvancingSampler(gpus, r.owner), SignalActuator(r.groups, killpg=kernel.killpg)))


def test_the_manager_reads_the_label_once_and_enforces_it_on_a_thread(short_tmp):
    gpus = make_backend().gpus
    proc = FakeProc(short_tmp / "proc")
    kernel = SimKernel(proc, gpus)
    manager = manager_on(short_tmp, "fs", None, gpus, kernel)
    p = pod("capped", NODE, [("main", {RESOURCE: "20"}, [(0, manager.cards[0].uuid, 200, 0)])], phase="Running",
            container_ids={"main": cid_of(1)})
    uid = p["metadata"]["uid"]
    write_pods(short_tmp / "pods.json", [p])
    manager.store.record(Grant(uid, "default", "capped", "main", RESOURCE, ("core-0-0",), 1),
                         [Share(uid, "default", "capped", "main", 0, manager.cards[0].uuid, 200, 0, "normal", 1)])
    proc.add(101, systemd(uid, cid_of(1)), 101)
    gpus[0].spawn(101, 1000)
    held = threading.Event()
    manager.start()
    try:
        assert manager.policy is Policy.FIXED_SHARE
        for _ in range(200):  # wait (not a timing bound) for the loop thread to act
            if signal.SIGSTOP in kernel.signalled(101):
                held.set()
                break
            threading.Event().wait(0.05)
        assert held.is_set()
        assert json.loads((short_tmp / "pods.node.json").read_text())["metadata"]["annotations"]["qgpu.io/isolation-policy"] == "fixed-share"
    finally:
        manager.stop()
        manager.store.close()
    # stopping resumed what the loop held
    assert gpus[0].processes[101].suspended_at is None


def test_the_manager_refuses_to_start_on_a_bad_label_and_serves_nothing(short_tmp):
    gpus = make_backend().gpus
    kernel = SimKernel(FakeProc(short_tmp / "proc"), gpus)
    manager = manager_on(short_tmp, "guaranteed", None, gpus, kernel)
    try:
        with pytest.raises(ValueError, match=rf"{POLICY_LABEL}: 'guaranteed'"):
            manager.start()
        assert not (short_tmp / "dp").exists() and manager.isolation is None
    finally:
        manager.stop()
        manager.store.close()


def test_the_command_line_reports_a_bad_label_and_exits_2(short_tmp, caplog):
    from qgpu_runtime.cli import main

    write_pods(short_tmp / "pods.json", [])
    (short_tmp / "pods.node.json").write_text(json.dumps({"metadata": {"name": NODE, "labels": {POLICY_LABEL: "strict"}}}))
    # `serve` installs SIGTERM/SIGINT handlers and a SIGUSR1 stack dump before starting: put them back
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with caplog.at_level(logging.ERROR):
            rc = main(["manager", "serve", "--nodename", NODE, "--dbfile", str(short_tmp / "meta.db"),
                       "--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G", "--pods-file", str(short_tmp / "pods.json"),
                       "--device-plugin-dir", str(short_tmp / "dp"), "--metrics-port", "-1", "--proc-root", str(short_tmp / "proc")])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        faulthandler.unregister(signal.SIGUSR1)
    assert rc == 2
    assert any(f"node label {POLICY_LABEL}: 'strict' is not a known isolation policy" in r.getMessage() for r in caplog.records)


class LostCard:
    """A sampler whose card fell off the bus (NVML raises) until ``back`` is set."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.back = False

    def sample(self, workloads, dt_s, held, slotted=None):
        if not self.back:
            raise RuntimeError("nvmlDeviceGetProcessUtilization: GPU is lost")
        return self.sampler.sample(workloads, dt_s, held, slotted)


def test_a_failing_tick_is_counted_logged_once_and_the_loop_goes_on(world_of, caplog):
    lost: list[LostCard] = []
    w = world_of(Policy.FIXED_SHARE, wrap_sampler=lambda s: lost.append(LostCard(s)) or lost[0])
    uid, cid = w.add_pod("a", 300)
    w.run_process(101, cgroupfs(uid, cid), 1000)
    with caplog.at_level(logging.ERROR, logger="qgpu.node.isolation"):
        for n in range(5):
            w.loop.tick_or_log(TICK, (n + 1) * TICK)
    assert len([r for r in caplog.records if "isolation tick failed" in r.getMessage()]) == 1
    assert w.samples()[("qgpu_isolation_tick_errors_total", frozenset())] == 5
    lost[0].back = True
    w.now = 5 * TICK
    w.drive(1.0)
    assert w.kernel.signalled(101)  # enforcing again


# ---- signalling only what the container owns ---------------------------------------------------
def test_a_reused_pid_is_not_signalled_as_the_containers(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("capped", 200)
    w.run_process(101, cgroupfs(uid, cid), 1000)
    w.drive(0.2)
    assert w.loop.engine.held == {"default/capped/main"}
    # the GPU process exits while held; the kernel gives PID 101 to a host process in its own group
    w.gpus[0].exit(101)
    w.proc.remove(101)
    w.proc.add(101, "0::/system.slice/sshd.service\n", pgid=101, start_time=2000)
    sent = len(w.kernel.sent)
    w.drive(2.0)
    assert [s for pgid, s in w.kernel.sent[sent:] if pgid == 101] == []


def test_a_pid_reused_inside_the_same_container_is_not_signalled_until_sampled_again(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("capped", 200)
    w.run_process(101, cgroupfs(uid, cid), 1000)
    w.drive(0.2)
    w.proc.remove(101)
    w.proc.add(101, cgroupfs(uid, cid), pgid=101, start_time=2000)
    assert w.loop.resolver.groups("default/capped/main") == []
    assert w.loop.resolver.owner(101) == "default/capped/main"  # the sampler attributes it anew
    assert w.loop.resolver.groups("default/capped/main") == [101]


def test_a_group_holding_a_process_outside_the_container_is_never_signalled(world_of, caplog):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("capped", 200)
    w.run_process(101, cgroupfs(uid, cid), 1000, pgid=101)
    w.proc.add(303, "0::/user.slice/user-1000.slice/session-3.scope\n", pgid=101)  # a host shell in that group
    with caplog.at_level(logging.WARNING, logger="qgpu.node.isolation"):
        w.drive(1.0)
    assert w.kernel.signalled(101) == []
    assert any("process group 101 of default/capped/main also holds process(es) 303 outside the container" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("pgid", [0, 1, os.getpgrp()], ids=["zero", "init", "own"])
def test_group_zero_init_and_the_managers_own_are_never_signalled(world_of, pgid):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("capped", 200)
    w.run_process(101, cgroupfs(uid, cid), 1000, pgid=pgid)
    w.drive(1.0)
    assert w.loop.engine.held == {"default/capped/main"}  # the engine wanted to hold it
    assert w.kernel.sent == []


class EndsAfterScan(ProcFS):
    """The node's proc root, where process ``pid`` ends just after a group scan listed it (a
    shell's short-lived child): it exits, or becomes a zombie whose cgroup no longer reads."""

    def __init__(self, proc: FakeProc, pid: int, ending: str) -> None:
        super().__init__(proc.root)
        self.proc, self.pid, self.ending = proc, pid, ending

    def group_members(self, pgid: int) -> list[int]:
        members = super().group_members(pgid)
        if self.pid in members:
            d = self.proc.root / str(self.pid)
            if self.ending == "exits":
                self.proc.remove(self.pid)
            else:
                (d / "stat").write_bytes((d / "stat").read_bytes().replace(b") S ", b") Z "))
                (d / "cgroup").unlink()
        return members


@pytest.mark.parametrize("ending", ["exits", "zombie"])
def test_a_group_member_that_ends_between_the_scan_and_its_cgroup_read_does_not_cancel_the_hold(world_of, ending):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("capped", 200)
    w.run_process(101, cgroupfs(uid, cid), 1000, pgid=101)
    w.proc.add(102, cgroupfs(uid, cid), pgid=101)  # the GPU process's short-lived child, in its group
    w.loop.resolver._proc = EndsAfterScan(w.proc, 102, ending)
    w.drive(TICK)
    assert w.loop.engine.held == {"default/capped/main"}
    assert w.kernel.signalled(101) == [signal.SIGSTOP] and w.gpus[0].processes[101].suspended_at is not None


def test_a_memory_offender_that_leaves_its_group_on_sigterm_is_killed_after_the_grace_period(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("hog", 300, memory_mib=1024)
    w.proc.add(200, cgroupfs(uid, cid), pgid=200)  # the container's shell, its group's leader
    w.run_process(202, cgroupfs(uid, cid), 300, pgid=200)  # its GPU child, in the shell's group

    def setsid() -> None:  # signal.signal(SIGTERM, lambda *_: os.setsid())
        w.proc.remove(202)
        w.proc.add(202, cgroupfs(uid, cid), pgid=202)

    w.kernel.handlers[(202, signal.SIGTERM)] = setsid
    w.drive(1.0)
    w.gpus[0].processes[202].memory_mib = 12288  # 12 GiB on a 1 GiB quota
    w.drive(5.0 + 2 * TICK)  # the grace period of a stop, and the tick that reaps it
    assert 202 not in w.gpus[0].processes
    assert (200, signal.SIGTERM) in w.kernel.sent and (202, signal.SIGKILL) in w.kernel.sent


# ---- what a process can name itself ----------------------------------------------------------
def test_a_host_process_named_in_bytes_that_are_not_utf8_breaks_no_tick_and_no_resume(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("victim", 200)
    w.run_process(101, cgroupfs(uid, cid), 1000)
    w.drive(TICK)
    # any local user renames a process: prctl(PR_SET_NAME, b"\xff\xfeevil")
    w.proc.add(4242, "0::/user.slice/user-1000.slice/session-3.scope\n", pgid=4242, comm=b"\xff\xfeevil")
    before = w.used(101)
    w.drive(5.0)
    assert (w.used(101) - before) / 5.0 == pytest.approx(200, abs=15)  # duty-cycled, never frozen
    assert w.samples()[("qgpu_isolation_tick_errors_total", frozenset())] == 0
    for _ in range(20):  # a 200 milli share is held most ticks
        if w.loop.engine.held:
            break
        w.drive(TICK)
    assert w.loop.engine.held == {"default/victim/main"}
    w.loop.close()
    assert w.kernel.signalled(101)[-1] is signal.SIGCONT and w.gpus[0].processes[101].suspended_at is None


def test_a_gpu_process_whose_main_thread_exited_is_enforced_like_any_other(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("threads", 300, memory_mib=1024)
    # pthread_exit() in main(): the leader reads "Z" while a thread drives the GPU
    w.proc.add(202, cgroupfs(uid, cid), pgid=202, state=b"Z", threads=2)
    w.gpus[0].spawn(202, 1000, 0)
    w.drive(5.0)
    assert w.used(202) / 5.0 == pytest.approx(300, abs=15)
    w.gpus[0].processes[202].memory_mib = 8192
    w.drive(0.5)
    assert 202 not in w.gpus[0].processes


def test_a_gpu_process_named_in_bytes_that_are_not_utf8_is_enforced_like_any_other(world_of):
    w = world_of(Policy.FIXED_SHARE)
    uid_n, cid_n = w.add_pod("neighbour", 300, memory_mib=1024)
    uid_r, cid_r = w.add_pod("renamed", 300, memory_mib=1024)
    w.run_process(101, cgroupfs(uid_n, cid_n), 1000)
    # a long UTF-8 file name the kernel cut mid-character
    w.proc.add(202, cgroupfs(uid_r, cid_r), pgid=202, comm="ab训练脚本程序".encode()[:15])
    w.gpus[0].spawn(202, 1000, 0)
    w.drive(5.0)
    assert w.used(202) / 5.0 == pytest.approx(300, abs=15) and w.used(101) / 5.0 == pytest.approx(300, abs=15)
    w.gpus[0].processes[202].memory_mib = 8192
    w.drive(0.5)
    assert 202 not in w.gpus[0].processes and 101 in w.gpus[0].processes


def test_the_memory_of_unmanaged_processes_logged_goes_with_them(tmp_path, caplog):
    """Each unmanaged GPU process is logged once while it lives; before, its (pid, start time) was
    kept for the manager's life, one entry per process that ever ran outside qgpu on the cards."""
    proc = FakeProc(tmp_path / "proc")
    resolver = ContainerResolver(proc.root)
    resolver.update([], [])
    with caplog.at_level(logging.INFO, logger="qgpu.node.isolation"):
        for pid in range(1000, 1050):
            proc.add(pid, "0::/user.slice/user-1000.slice/session-3.scope\n", pid)
            assert resolver.owner(pid) is None
            assert resolver.owner(pid) is None  # logged once
    assert len([r for r in caplog.records if "left alone" in r.getMessage()]) == 50
    for pid in range(1000, 1049):
        proc.remove(pid)
    resolver.update([], [])
    assert resolver._logged == {(1049, "1000")}


def test_a_worker_its_own_helper_resumes_while_held_is_held_again_and_kept_to_its_share(world_of, caplog):
    """A helper process of the tenant, in a group of its own (never signalled), sends SIGCONT to
    the held GPU worker: the hold was sent once, on the change, and the worker ran on (helper
    audit, 2026-12-01): 990 of 1000 against a 250 share. The loop reads the worker's state each
    tick and holds it again: what the helper wins is the rest of the tick after each resume (a
    helper resuming every millisecond keeps most of the card: docs/security.md, what stays
    possible)."""
    w = world_of(Policy.FIXED_SHARE)
    uid, cid = w.add_pod("sly", 250)
    w.run_process(101, cgroupfs(uid, cid), 1000)
    resume = {n: (lambda: w.kernel.deliver(101, signal.SIGCONT)) for n in range(0, 200, 3)}  # every 150 ms
    with caplog.at_level(logging.WARNING, logger="qgpu.isolation.engine"):
        w.drive(10.0, events=resume)
    # a third of the ticks resumed, each run until the next tick's hold: about 250 + 1000 / 3 · (1 - 0.25)
    assert w.used(101) / 10.0 < 400
    assert any("runs while held" in r.getMessage() for r in caplog.records)


def test_one_scan_of_proc_serves_every_signal_of_a_tick(world_of, monkeypatch):
    """Each signal's safety check scanned all of /proc once per process group: a tenant with
    thousands of idle processes and several GPU groups made every tick cost seconds for the whole
    node (helper audit, 2026-12-01). Now one scan serves a tick's signals."""
    from qgpu_runtime.isolation.procfs import ProcFS

    scans = []
    real = ProcFS.group_index
    monkeypatch.setattr(ProcFS, "group_index", lambda self: scans.append(1) or real(self))
    w = world_of(Policy.FIXED_SHARE)
    for i, share in enumerate((200, 300, 400)):
        uid, cid = w.add_pod(f"t{i}", share)
        for j in range(3):  # three GPU processes, each in a group of its own
            pid = 100 + 10 * i + j
            w.run_process(pid, cgroupfs(uid, cid), 1000, pgid=pid)
    w.drive(2.0)
    ticks = round(2.0 / TICK)
    signalled = sum(1 for _ in w.kernel.sent)
    assert signalled > ticks  # several groups signalled in many ticks
    assert len(scans) <= ticks  # never more than one scan a tick
