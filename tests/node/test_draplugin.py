"""The DRA kubelet plugin (node/dra/plugin.py) over its real unix sockets, with a test gRPC client
standing in for kubelet: registration, prepare and unprepare, idempotency, restarts, refusals.

Claims come from a dict standing in for the apiserver (tests/k8s/test_e2e_draplugin.py reads them
from a real kube-apiserver); everything else — store, CDI folder, sockets — is real.
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
import time
from pathlib import Path

import pytest
from drakubelet import Kubelet

from qgpu_runtime.contract import dra, draclaim
from qgpu_runtime.contract.dra import DRIVER
from qgpu_runtime.contract.names import MIXED_LABEL
from qgpu_runtime.contract.record import CardShare
from qgpu_runtime.contract.store import read_status
from qgpu_runtime.gpu.simulated import build_cards, parse_spec
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.node.dra import cdi
from qgpu_runtime.node.dra.health import HEALTH_RESEND_S, HEALTH_TIMEOUT_S
from qgpu_runtime.node.dra.plugin import DraKubeletPlugin
from qgpu_runtime.node.dra.preparer import ClaimPreparer, ClaimRefused
from qgpu_runtime.node.dra.settings import DraSettings
from qgpu_runtime.node.health import CardHealth
from qgpu_runtime.node.pods import FilePodSource
from qgpu_runtime.node.reconciler import Reconciler
from qgpu_runtime.node.store import Grant, Share, Store
from tests.recordkeys import VERIFIER

NODE = "gpu-node-1"
CARDS = {c.index: c for c in build_cards(parse_spec("2xT4-16G"), NODE)}


class Claims:
    """The apiserver's ResourceClaims by (namespace, name); counts reads."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {}
        self.reads = 0

    def add(self, obj: dict) -> dict:
        meta = obj["metadata"]
        self.objects[(meta["namespace"], meta["name"])] = obj
        return obj

    def resource_claim(self, namespace: str, name: str) -> dict:
        self.reads += 1
        try:
            return self.objects[(namespace, name)]
        except KeyError:
            raise RuntimeError(f"reading ResourceClaim {namespace}/{name}: HTTP 404 not found") from None


def claim(uid: str, name: str = "train", namespace: str = "team-a", results: list[dict] | None = None) -> dict:
    if results is None:
        results = [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0",
                    "consumedCapacity": {"core": "300", "memory": "4096", "pods": "1"}, "shareID": f"share-{uid}"}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": namespace, "name": name, "uid": uid},
            "spec": {"devices": {"requests": _requests_of(results)}},
            "status": {"allocation": {"devices": {"results": results}}}}


def _requests_of(results: list[dict]) -> list[dict]:
    """The spec a claim with these results was allocated from: per request name, as many devices of
    qgpu's shared class as it was given (``parent/sub``: a prioritized list's subrequest)."""
    counts: dict[str, int] = {}
    for r in results:
        counts[str(r.get("request") or "")] = counts.get(str(r.get("request") or ""), 0) + 1
    out = []
    for name, n in counts.items():
        parent, _, sub = name.partition("/")
        exactly = {"deviceClassName": dra.SHARED_CLASS, "allocationMode": "ExactCount", "count": n}
        out.append({"name": parent, "firstAvailable": [{"name": sub, **exactly}]} if sub else {"name": name, "exactly": exactly})
    return out


class Plugin:
    """One plugin process: preparer + servers over a store and a CDI folder that outlive it."""

    def __init__(self, root: Path, claims: Claims, devices: set[str] | None = None,
                 health_resend_s: float = HEALTH_RESEND_S) -> None:
        self.settings = DraSettings(NODE, root / "plugins", root / "plugins_registry", root / "cdi")
        self.store = Store(root / "meta.db")
        self.store.sync_cards(list(CARDS.values()))
        existing = devices if devices is not None else {"/dev/nvidia0", "/dev/nvidiactl"}
        self.health = CardHealth(CARDS)
        self.labels: dict[str, str] = {MIXED_LABEL: "enable"}  # a mixed node unless a test says otherwise

        def node_labels() -> dict[str, str]:
            if isinstance(self.labels, Exception):
                raise self.labels
            return self.labels

        self.preparer = ClaimPreparer(self.settings, CARDS, self.store, claims, lambda: "fixed-share",
                                      self.health.unhealthy, device_exists=existing.__contains__, node_labels=node_labels)
        self.server = DraKubeletPlugin(self.settings, self.preparer, self.health, health_resend_s)
        self.server.serve()
        self.kubelet = Kubelet(self.settings)

    def stop(self) -> None:
        self.server.stop()
        self.store.close()


@pytest.fixture
def root():
    with tempfile.TemporaryDirectory(prefix="qgpu-dra-", dir="/tmp") as d:  # unix socket paths stay short
        yield Path(d)


@pytest.fixture
def claims():
    return Claims()


@pytest.fixture
def plugin(root, claims):
    p = Plugin(root, claims)
    yield p
    p.stop()


def _spec(plugin: Plugin, uid: str) -> dict | None:
    return cdi.read_spec(cdi.spec_path(plugin.settings.cdi_dir, uid))


def _claim_shares(plugin: Plugin, uid: str) -> list[Share]:
    return [s for s in plugin.store.shares() if s.workload_id == uid]


def test_registration_answers_kubelets_plugin_watcher(plugin):
    info = plugin.kubelet.get_info()
    # kubelet 1.37 (plugin/dra_plugin_manager.go) picks v1.DRAPlugin and, as it is listed, watches
    # v1.DRAResourceHealth on the same endpoint.
    assert (info.type, info.name, list(info.supported_versions)) == (
        "DRAPlugin", DRIVER, ["v1.DRAPlugin", "v1.DRAResourceHealth"])
    assert info.endpoint == str(plugin.settings.dra_socket) and Path(info.endpoint).is_absolute()
    assert plugin.settings.registration_socket.name == "gpu.qgpu.io-reg.sock"
    assert plugin.settings.dra_socket.parts[-2:] == (DRIVER, "dra.sock")
    plugin.kubelet.notify(True)
    assert plugin.server.registered == (True, "")


def test_prepare_books_the_share_and_writes_the_cdi_spec(plugin, claims):
    claims.add(claim("uid-1"))
    answer = plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"]
    assert answer.error == ""
    (device,) = answer.devices
    assert (list(device.request_names), device.pool_name, device.device_name) == (["gpu"], NODE, "gpu-0")
    assert list(device.cdi_device_ids) == ["gpu.qgpu.io/claim=uid-1-0"] and device.share_id == "share-uid-1"
    spec = _spec(plugin, "uid-1")
    assert (spec["cdiVersion"], spec["kind"]) == (cdi.CDI_VERSION, "gpu.qgpu.io/claim")
    (edits,) = [d["containerEdits"] for d in spec["devices"] if d["name"] == "uid-1-0"]
    assert set(edits["env"]) == {
        f"NVIDIA_VISIBLE_DEVICES={CARDS[0].uuid}", "QGPU_CORE_MILLI=300", "QGPU_MEMORY_MIB=4096",
        "QGPU_POLICY=fixed-share", "QGPU_CLASS=normal",
        "T9K_GPU_MODE=sgn", "T9K_GPU_COUNT=1", "T9K_GPU_PERCENT=25", "T9K_GPU_MEMORY=4096"}
    assert _claim_shares(plugin, "uid-1") == [
        Share("uid-1", "team-a", "train", "gpu", 0, CARDS[0].uuid, 300, 4096, "normal", _claim_shares(plugin, "uid-1")[0].created_ns)]
    status = read_status(plugin.store.path)  # what `qgpu status` reads
    assert ("team-a", "train", "gpu", 0, 300, 4096, "normal") in status.shares


def test_device_nodes_are_passed_only_where_the_host_has_them(plugin, claims):
    claims.add(claim("uid-1"))
    plugin.kubelet.prepare(("team-a", "uid-1", "train"))
    (device,) = _spec(plugin, "uid-1")["devices"]
    assert device["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}, {"path": "/dev/nvidiactl"}]


def test_the_cdi_spec_names_the_card_by_a_read_only_dev_null_mount(plugin, claims):
    """What gives the container its card where the nvidia_container_toolkit role made the toolkit
    ignore NVIDIA_VISIBLE_DEVICES of unprivileged containers (docs/dra.md)."""
    claims.add(claim("uid-1"))
    plugin.kubelet.prepare(("team-a", "uid-1", "train"))
    (device,) = _spec(plugin, "uid-1")["devices"]
    assert device["containerEdits"]["mounts"] == [{
        "hostPath": "/dev/null", "containerPath": f"/var/run/nvidia-container-devices/{CARDS[0].uuid}",
        "options": ["ro", "nosuid", "nodev", "bind"]}]


def test_each_device_of_a_two_card_claim_mounts_only_its_own_card():
    """A container given one result of the claim gets that card, as with the device nodes."""
    shares = [CardShare(1, CARDS[1].uuid, 1000, 16384), CardShare(0, CARDS[0].uuid, 1000, 16384)]
    devices = cdi.spec(cdi.claim_devices("uid", shares, CARDS, "normal", "fixed-share", lambda index: ()))["devices"]
    assert [[m["containerPath"] for m in d["containerEdits"]["mounts"]] for d in devices] == [
        [f"/var/run/nvidia-container-devices/{CARDS[1].uuid}"], [f"/var/run/nvidia-container-devices/{CARDS[0].uuid}"]]


def test_a_claim_with_another_uid_is_refused_and_the_others_prepared(plugin, claims):
    claims.add(claim("uid-new", name="train"))
    claims.add(claim("uid-2", name="infer"))
    answers = plugin.kubelet.prepare(("team-a", "uid-old", "train"), ("team-a", "uid-2", "infer"))
    assert "has UID 'uid-new', not the one kubelet asked for" in answers["uid-old"].error
    assert not answers["uid-old"].devices and _spec(plugin, "uid-old") is None
    assert answers["uid-2"].error == "" and len(answers["uid-2"].devices) == 1
    assert {s.workload_id for s in plugin.store.shares()} == {"uid-2"}


def test_prepare_twice_answers_the_same_devices_and_books_once(plugin, claims):
    claims.add(claim("uid-1"))
    first = plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"]
    second = plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"]
    assert second == first
    assert len(_claim_shares(plugin, "uid-1")) == 1
    assert claims.reads == 1  # the second answer came from the store


def test_unprepare_frees_the_card_and_removes_the_spec(plugin, claims):
    claims.add(claim("uid-1"))
    plugin.kubelet.prepare(("team-a", "uid-1", "train"))
    answer = plugin.kubelet.unprepare(("team-a", "uid-1", "train"))["uid-1"]
    assert answer.error == ""
    assert _claim_shares(plugin, "uid-1") == [] and plugin.store.prepared_claim("uid-1") is None
    assert _spec(plugin, "uid-1") is None


def test_a_restarted_plugin_unprepares_what_the_previous_one_prepared(root, claims):
    claims.add(claim("uid-1"))
    first = Plugin(root, claims)
    first.kubelet.prepare(("team-a", "uid-1", "train"))
    first.stop()
    second = Plugin(root, claims)
    try:
        assert second.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].devices[0].device_name == "gpu-0"
        assert claims.reads == 1
        assert second.kubelet.unprepare(("team-a", "uid-1", "train"))["uid-1"].error == ""
        assert second.store.shares() == [] and _spec(second, "uid-1") is None
    finally:
        second.stop()


@pytest.mark.parametrize("uid", ["../../../etc/x", "a/b", "uid.1", "x" * 129])
def test_a_claim_uid_that_is_no_kubernetes_uid_names_no_file(plugin, claims, uid):
    """The UID reaches a file name before any check against the apiserver: before, a prepare read,
    and an unprepare removed, ``<cdi-dir>/gpu.qgpu.io-claim_<uid>.json`` for whatever kubelet sent."""
    claims.add(claim(uid))
    for answer in (plugin.kubelet.prepare(("team-a", uid, "train"))[uid], plugin.kubelet.unprepare(("team-a", uid, "train"))[uid]):
        assert "must be 1 to 128 ASCII letters, digits or '-' (a Kubernetes UID)" in answer.error
    assert claims.reads == 0 and plugin.store.shares() == []


def test_unprepare_of_a_claim_never_prepared_succeeds(plugin):
    assert plugin.kubelet.unprepare(("team-a", "uid-x", "nothing"))["uid-x"].error == ""


def test_a_crash_between_booking_and_spec_is_repaired_by_the_next_prepare(plugin, claims):
    claims.add(claim("uid-1"))
    plugin.kubelet.prepare(("team-a", "uid-1", "train"))
    cdi.spec_path(plugin.settings.cdi_dir, "uid-1").unlink()  # as if the process died before the rename
    answer = plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"]
    assert answer.error == "" and _spec(plugin, "uid-1") is not None
    assert len(_claim_shares(plugin, "uid-1")) == 1


@pytest.mark.parametrize("consumed, field", [
    ({"core": "30%", "memory": "4096"}, "consumedCapacity.core='30%': must be a non-negative whole number"),
    ({"core": "300", "memory": "4Gi"}, "consumedCapacity.memory='4Gi': must be a non-negative whole number"),
    ({"core": "300"}, "consumedCapacity {'core': '300'} is not allowed: it must name 'core' and 'memory'"),
    (None, "consumedCapacity is missing"),
])
def test_a_malformed_allocation_is_refused_naming_the_field(plugin, claims, consumed, field):
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}
    if consumed is not None:
        result["consumedCapacity"] = consumed
    claims.add(claim("uid-1", results=[result]))
    error = plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error
    assert "ResourceClaim team-a/train: status.allocation.devices.results[0]" in error and field in error
    assert plugin.store.shares() == [] and _spec(plugin, "uid-1") is None


def test_an_unallocated_claim_is_refused(plugin, claims):
    obj = claim("uid-1")
    del obj["status"]
    claims.add(obj)
    assert "status.allocation is missing" in plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error


def test_a_claim_that_would_over_book_a_card_is_refused(plugin, claims):
    plugin.store.record(Grant("pod-1", "team-b", "big", "main", "tke.cloud.tencent.com/qgpu-core", ("d",), 1),
                        [Share("pod-1", "team-b", "big", "main", 0, CARDS[0].uuid, 800, 2048, "normal", 1)])
    claims.add(claim("uid-1"))
    error = plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error
    assert "would over-book this node" in error and "card 0" in error
    assert _claim_shares(plugin, "uid-1") == [] and _spec(plugin, "uid-1") is None


def _on(device: str, core: int, request: str = "gpu", uid: str = "") -> dict:
    return {"request": request, "driver": DRIVER, "pool": NODE, "device": device,
            "consumedCapacity": {"core": str(core), "memory": "1024", "pods": "1"}, "shareID": f"share-{uid}-{device}"}


def test_every_card_of_a_multi_card_holder_counts_against_a_new_claim(plugin, claims):
    """A claim of two devices (600 thousandths on cards 0 and 1) is still prepared; a claim given
    600 on card 1 would take that card to 1200. The guard counted one commitment per store row and
    each holder once, so the holder's second card was never counted (the window the docs name:
    a claim deallocated while kubelet has not unprepared it, or a scheduler that lost count)."""
    claims.add(claim("uid-a", name="a", results=[_on("gpu-0", 600, uid="a"), _on("gpu-1", 600, uid="a")]))
    assert plugin.kubelet.prepare(("team-a", "uid-a", "a"))["uid-a"].error == ""
    claims.add(claim("uid-b", name="b", results=[_on("gpu-1", 600, uid="b")]))
    error = plugin.kubelet.prepare(("team-a", "uid-b", "b"))["uid-b"].error
    assert "would over-book this node" in error and "card 1: core 1200‰ committed > 1000‰" in error, error
    assert _claim_shares(plugin, "uid-b") == []
    # and a device-plugin container on both cards counts for both, too
    plugin.kubelet.unprepare(("team-a", "uid-a", "a"))
    plugin.store.record(Grant("pod-1", "team-b", "big", "main", "tke.cloud.tencent.com/qgpu-core", ("d0", "d1"), 2),
                        [Share("pod-1", "team-b", "big", "main", i, CARDS[i].uuid, 600, 1024, "normal", 1) for i in (0, 1)])
    error = plugin.kubelet.prepare(("team-a", "uid-b", "b"))["uid-b"].error
    assert "card 1: core 1200‰ committed > 1000‰" in error, error


def test_two_claims_that_fit_share_a_card(plugin, claims):
    claims.add(claim("uid-1", name="a"))
    claims.add(claim("uid-2", name="b"))
    answers = plugin.kubelet.prepare(("team-a", "uid-1", "a"), ("team-a", "uid-2", "b"))
    assert answers["uid-1"].error == answers["uid-2"].error == ""
    assert sum(s.core_milli for s in plugin.store.shares() if s.card_index == 0) == 600


def test_a_card_the_node_does_not_have_is_refused(plugin, claims):
    claims.add(claim("uid-1", results=[{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-7",
                                        "consumedCapacity": {"core": "300", "memory": "4096"}}]))
    assert "names card 7, which this node does not have" in plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error


def _whole_node(root: Path, claims: Claims, n_cards: int) -> tuple[ClaimPreparer, Store]:
    cards = {c.index: c for c in build_cards(parse_spec(f"{n_cards}xT4-16G"), NODE)}
    store = Store(root / "meta.db")
    store.sync_cards(list(cards.values()))
    settings = DraSettings(NODE, root / "plugins", root / "plugins_registry", root / "cdi")
    return ClaimPreparer(settings, cards, store, claims, lambda: "fixed-share", device_exists=lambda _: True), store


def _asking(obj: dict, *requests: dict) -> dict:
    obj["spec"]["devices"]["requests"] = list(requests)
    return obj


ALL_CARDS = {"name": "gpus", "exactly": {"deviceClassName": dra.WHOLE_CLASS, "allocationMode": "All"}}


def _whole_cards(request: str, cards: range) -> list[dict]:
    return [{"request": request, "driver": DRIVER, "pool": NODE, "device": dra.device_name(i),
             "consumedCapacity": {"core": "1000", "memory": "16384"}} for i in cards]


def test_an_all_request_is_refused_more_cards_than_the_quota_charged_it(root, claims):
    """allocationMode All is charged max_cards_per_node cards (webhook/claimquota.py); on a node of
    more cards kube-scheduler's allocator gives it every one: the node prepares none of them."""
    limit = DEFAULT_LIMITS.max_cards_per_node
    preparer, store = _whole_node(root, claims, limit + 2)
    try:
        claims.add(_asking(claim("uid-1", results=_whole_cards("gpus", range(limit + 2))), ALL_CARDS))
        with pytest.raises(ClaimRefused) as refused:
            preparer.prepare("team-a", "uid-1", "train")
        assert (f"request 'gpus' (allocationMode All) was allocated {limit + 2} cards of this node, but a claim is "
                f"charged at most {limit} (CardLimits.max_cards_per_node)") in str(refused.value)
        assert store.shares() == [] and cdi.read_spec(cdi.spec_path(preparer.settings.cdi_dir, "uid-1")) is None
        # the same request given as many cards as it was charged (two were taken) is prepared
        claims.add(_asking(claim("uid-2", name="other", results=_whole_cards("gpus", range(limit))), ALL_CARDS))
        assert len(preparer.prepare("team-a", "uid-2", "other")) == limit
    finally:
        store.close()


def test_a_request_of_another_deviceclass_given_qgpus_cards_is_refused(root, claims):
    """A DeviceClass other than qgpu's whose selector matches qgpu's cards (an admin's catch-all):
    the quota charges only qgpu's classes, so its claims were prepared for nothing."""
    preparer, store = _whole_node(root, claims, 2)
    try:
        other = {"name": "gpus", "exactly": {"deviceClassName": "any-gpu.example.com", "allocationMode": "ExactCount", "count": 2}}
        claims.add(_asking(claim("uid-1", results=_whole_cards("gpus", range(2))), other))
        with pytest.raises(ClaimRefused, match="request 'gpus' was allocated qgpu's devices but does not ask one of qgpu's "
                                               r"DeviceClasses \(shared.gpu.qgpu.io, whole.gpu.qgpu.io\)"):
            preparer.prepare("team-a", "uid-1", "train")
        assert store.shares() == []
    finally:
        store.close()


def test_a_request_given_more_devices_than_its_count_is_refused(root, claims):
    preparer, store = _whole_node(root, claims, 2)
    try:
        counted = {"name": "gpus", "firstAvailable": [
            {"name": "one", "deviceClassName": dra.WHOLE_CLASS, "allocationMode": "ExactCount", "count": 1}]}
        claims.add(_asking(claim("uid-1", results=_whole_cards("gpus/one", range(2))), counted))
        with pytest.raises(ClaimRefused, match="request 'gpus/one' was allocated 2 devices, more than its count 1"):
            preparer.prepare("team-a", "uid-1", "train")
        assert store.shares() == []
    finally:
        store.close()


def test_a_claim_missing_from_the_apiserver_is_that_claims_error(plugin):
    assert "HTTP 404" in plugin.kubelet.prepare(("team-a", "uid-1", "gone"))["uid-1"].error


def test_whole_cards_read_as_t9k_xgn_and_every_device_carries_the_claims_cards(plugin, claims):
    whole = {"core": "1000", "memory": "16384"}
    claims.add(claim("uid-1", results=[
        {"request": "gpus", "driver": DRIVER, "pool": NODE, "device": f"gpu-{i}", "consumedCapacity": whole} for i in (0, 1)]))
    answer = plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"]
    assert [list(d.cdi_device_ids) for d in answer.devices] == [["gpu.qgpu.io/claim=uid-1-0"], ["gpu.qgpu.io/claim=uid-1-1"]]
    envs = [set(d["containerEdits"]["env"]) for d in _spec(plugin, "uid-1")["devices"]]
    assert envs[0] == envs[1]
    assert {f"NVIDIA_VISIBLE_DEVICES={CARDS[0].uuid},{CARDS[1].uuid}", "T9K_GPU_MODE=xgn", "T9K_GPU_COUNT=2"} <= envs[0]


def test_the_reconciler_leaves_claim_shares_to_kubelet(plugin, claims, root):
    claims.add(claim("uid-1"))
    plugin.kubelet.prepare(("team-a", "uid-1", "train"))
    pods = root / "pods.json"
    pods.write_text(json.dumps({"items": []}))

    class Config:
        node = NODE
        state_dir = root / "state"
        pod_resources_socket = root / "no-kubelet.sock"

    import threading

    reconciler = Reconciler(Config(), plugin.store, FilePodSource(pods), threading.Lock())
    assert reconciler.release_gone() == {} and reconciler.reconcile().release_pods == {}
    assert len(_claim_shares(plugin, "uid-1")) == 1


def test_a_claim_booked_between_two_reads_of_the_reconciler_is_not_released(plugin, claims):
    """The reconciler read the claims' UIDs, then the shares: a claim the DRA plugin booked between
    the two reads (under its own lock) looked like the shares of a pod that is gone, and was
    released. One read now, and the store never releases a prepared claim's shares as a pod's."""
    claims.add(claim("uid-1"))
    assert plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error == ""
    assert plugin.store.pod_shares() == [] and len(plugin.store.shares()) == 1
    assert plugin.store.release_pods(["uid-1"]) == 0  # what the stale plan asked for
    assert len(_claim_shares(plugin, "uid-1")) == 1


def test_a_store_of_the_previous_release_gets_the_claims_table_and_keeps_its_version(root):
    dump = Path(__file__).parents[1] / "contract" / "previous_release" / "node_store_v1.sql"
    db = sqlite3.connect(root / "old.db")
    db.executescript(dump.read_text())
    db.close()
    store = Store(root / "old.db")
    try:
        assert store.claim_uids() == set() and len(store.shares()) == 1
        assert store.meta("schema_version") == "1"  # a table only: 0.1.0 still opens the file
    finally:
        store.close()


def test_the_manager_with_dra_serves_the_dra_plugin_instead_of_device_plugins(root):
    from qgpu_runtime.gpu.simulated import SimulatedBackend
    from qgpu_runtime.node.deviceplugin.resources import DEFAULT_RESOURCES, parse_resources
    from qgpu_runtime.node.manager import ManagerConfig, NodeManager

    pods = root / "pods.json"
    pods.write_text(json.dumps({"items": []}))
    config = ManagerConfig(node=NODE, resources=parse_resources(",".join(DEFAULT_RESOURCES)), plugin_dir=root / "dp",
                           pod_resources_socket=root / "none.sock", state_dir=root / "state", label_node=False,
                           isolation_policy="fixed-share", dra=True, cdi_dir=root / "cdi",
                           kubelet_plugins_dir=root / "plugins", plugins_registry_dir=root / "registry", record_verifier=VERIFIER)
    from tests.node.test_draslices import FakeSlices

    slices = FakeSlices()
    slices.node_uids = {NODE: "uid-1"}
    store = Store(root / "meta.db")
    manager = NodeManager(config, SimulatedBackend(tuple(CARDS.values())), store, FilePodSource(pods), slice_api=slices)
    try:
        assert manager.start()
        info = Kubelet(manager.registration.settings).get_info()
        assert (info.name, info.endpoint) == (DRIVER, str(root / "plugins" / DRIVER / "dra.sock"))
        assert (root / "registry" / "gpu.qgpu.io-reg.sock").is_socket()
        assert not (root / "dp").exists() or not any((root / "dp").iterdir())
        wait_until = time.monotonic() + 10
        while dra.slice_name(NODE) not in slices.objects and time.monotonic() < wait_until:
            time.sleep(0.05)
        assert [d["name"] for d in slices.objects[dra.slice_name(NODE)]["spec"]["devices"]] == ["gpu-0", "gpu-1"][:len(CARDS)]
        channel, stream = Kubelet(manager.registration.settings).watch_health()  # the manager's CardHealth
        with channel:
            assert _health(next(stream))[(NODE, "gpu-0")] == ("HEALTHY", "")
            manager.health.mark(0, "XID 79")
            assert _health(next(stream))[(NODE, "gpu-0")] == ("UNHEALTHY", "XID 79")
            stream.cancel()
    finally:
        manager.stop()
        store.close()
    assert not (root / "registry" / "gpu.qgpu.io-reg.sock").exists()


def test_manager_serve_dra_refuses_a_pods_file(root, caplog):
    from qgpu_runtime.cli import main

    assert main(["manager", "serve", "--nodename", NODE, "--dbfile", str(root / "m.db"), "--gpu-backend", "simulated",
                 "--simulated-gpus", "2xT4-16G", "--pods-file", str(root / "p.json"), "--dra"]) == 2
    assert "--dra reads ResourceClaims and publishes ResourceSlices through the Kubernetes API" in caplog.text


# ---- the claim's opaque ShareConfig and its reserved pods ------------------------------------------
def _configured(uid: str, *configs: dict, where: str = "spec", results: list[dict] | None = None,
                reserved: list[dict] | None = None) -> dict:
    obj = claim(uid, results=results)
    if where == "spec":
        obj["spec"]["devices"]["config"] = list(configs)
    else:
        obj["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", **c} for c in configs]
    if reserved is not None:
        obj["status"]["reservedFor"] = reserved
    return obj


def _opaque(parameters, requests=("gpu",), driver: str = DRIVER) -> dict:
    return {"requests": list(requests), "opaque": {"driver": driver, "parameters": parameters}}


@pytest.mark.parametrize("where", ["spec", "status"])
def test_the_class_of_the_claims_share_config_is_booked_and_set_in_the_cdi_env(plugin, claims, where):
    claims.add(_configured("uid-1", _opaque(draclaim.share_config("offline", True)), where=where))
    assert plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error == ""
    assert [s.klass for s in _claim_shares(plugin, "uid-1")] == ["offline"]
    (device,) = _spec(plugin, "uid-1")["devices"]
    assert "QGPU_CLASS=offline" in device["containerEdits"]["env"]
    assert ("team-a", "train", "gpu", 0, 300, 4096, "offline") in read_status(plugin.store.path).shares


@pytest.mark.parametrize("klass", ["online", "offline"])
def test_an_online_or_offline_claim_is_refused_on_a_node_that_is_not_mixed(plugin, claims, klass):
    """The class is the tenant's word (the claim's ShareConfig); an online share books no core and
    is never throttled. Like the extender's placement, the node takes online and offline work only
    when labelled mixed-qgpu-enable=enable; a claim written by hand meets this check."""
    plugin.labels = {"other": "label"}
    claims.add(_configured("uid-1", _opaque(draclaim.share_config(klass, klass == "offline"))))
    error = plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error
    assert f"asks the {klass} class (ShareConfig appClass), but node {NODE} is not labelled {MIXED_LABEL}=enable" in error
    assert _claim_shares(plugin, "uid-1") == [] and not read_status(plugin.store.path).shares
    plugin.labels = OSError("apiserver unreachable")
    error = plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error
    assert f"cannot read node {NODE}'s labels to check {MIXED_LABEL}=enable: apiserver unreachable" in error
    plugin.labels = {MIXED_LABEL: "enable"}
    assert plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error == ""
    assert [s.klass for s in _claim_shares(plugin, "uid-1")] == [klass]


def test_a_normal_claim_needs_no_mixed_node(plugin, claims):
    plugin.labels = OSError("not read for a normal claim")
    claims.add(_configured("uid-1", _opaque(draclaim.share_config("normal", False))))
    assert plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error == ""


def test_a_hami_claims_dialect_gives_its_container_hamis_limits_as_the_device_plugin_does(plugin, claims):
    from qgpu_runtime.contract.record import ContainerDialect

    claims.add(_configured("uid-1", _opaque(draclaim.share_config("normal", False, ContainerDialect("hami")))))
    assert plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error == ""
    (device,) = _spec(plugin, "uid-1")["devices"]
    env = set(device["containerEdits"]["env"])
    assert {"CUDA_DEVICE_MEMORY_LIMIT_0=4096m", "CUDA_DEVICE_SM_LIMIT=30", "QGPU_CORE_MILLI=300"} <= env
    assert not [e for e in env if e.startswith("T9K_GPU_")]  # the shares no longer decide T9k's mode


def test_a_kai_memory_only_claim_is_booked_without_core_and_sees_its_portion(plugin, claims):
    from qgpu_runtime.contract.record import ContainerDialect

    claims.add(_configured("uid-1", _opaque(draclaim.share_config("normal", False, ContainerDialect("kai", 50), memory_only=True))))
    assert plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error == ""
    env = set(_spec(plugin, "uid-1")["devices"][0]["containerEdits"]["env"])
    assert {"GPU_PORTION=0.5", "QGPU_CORE_MILLI=0", "QGPU_MEMORY_MIB=4096"} <= env
    assert ("team-a", "train", "gpu", 0, 0, 4096, "normal") in read_status(plugin.store.path).shares


def test_a_t9k_whole_node_claim_announces_the_node_mode(plugin, claims):
    from qgpu_runtime.contract.record import ContainerDialect

    claims.add(_configured("uid-1", _opaque(draclaim.share_config("normal", False, ContainerDialect("t9k", whole_node=True)))))
    assert plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error == ""
    assert "T9K_GPU_MODE=node" in _spec(plugin, "uid-1")["devices"][0]["containerEdits"]["env"]


def test_the_allocations_copy_of_the_config_wins_over_the_spec(plugin, claims):
    obj = _configured("uid-1", _opaque(draclaim.share_config("online", False)), where="status")
    obj["spec"]["devices"]["config"] = [_opaque(draclaim.share_config("offline", True))]
    claims.add(obj)
    plugin.kubelet.prepare(("team-a", "uid-1", "train"))
    assert [s.klass for s in _claim_shares(plugin, "uid-1")] == ["online"]


def test_a_config_applies_to_the_requests_it_names_and_other_drivers_configs_are_skipped(plugin, claims):
    results = [{"request": r, "driver": DRIVER, "pool": NODE, "device": d,
                "consumedCapacity": {"core": "300", "memory": "4096"}} for r, d in (("a", "gpu-0"), ("b", "gpu-1"))]
    claims.add(_configured("uid-1", _opaque(draclaim.share_config("offline", True), requests=["a"]),
                           _opaque({"anything": 1}, requests=[], driver="other.example.com"), results=results))
    assert plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error == ""
    assert {s.container: s.klass for s in _claim_shares(plugin, "uid-1")} == {"a": "offline", "b": "normal"}
    # one environment per claim: the class the isolation loop gives a tenant holding both
    assert {"QGPU_CLASS=normal"} <= set(_spec(plugin, "uid-1")["devices"][0]["containerEdits"]["env"])


def test_a_config_without_requests_applies_to_every_request_and_subrequests_follow_their_parent(plugin, claims):
    results = [{"request": "gpu/t4", "driver": DRIVER, "pool": NODE, "device": "gpu-0",
                "consumedCapacity": {"core": "300", "memory": "4096"}}]
    claims.add(_configured("uid-1", _opaque(draclaim.share_config("online", False), requests=[]), results=results))
    plugin.kubelet.prepare(("team-a", "uid-1", "train"))
    assert [s.klass for s in _claim_shares(plugin, "uid-1")] == ["online"]


@pytest.mark.parametrize("parameters, field", [
    ({"apiVersion": "gpu.qgpu.io/v1alpha1", "kind": "ShareConfig", "appClass": "batch"},
     "spec.devices.config[0].opaque.parameters: opaque parameters"),
    ({"apiVersion": "gpu.qgpu.io/v1alpha1", "kind": "ShareConfig", "greedy": "yes"},
     "spec.devices.config[0].opaque.parameters: opaque parameters"),
    ({"apiVersion": "gpu.qgpu.io/v2", "kind": "ShareConfig"}, "expected apiVersion gpu.qgpu.io/v1alpha1, kind ShareConfig"),
    (None, "spec.devices.config[0].opaque.parameters"),
])
def test_a_malformed_share_config_refuses_the_claim_naming_the_field(plugin, claims, parameters, field):
    claims.add(_configured("uid-1", _opaque(parameters)))
    claims.add(claim("uid-2", name="fine"))
    answers = plugin.kubelet.prepare(("team-a", "uid-1", "train"), ("team-a", "uid-2", "fine"))
    assert answers["uid-1"].error.startswith("ResourceClaim team-a/train: ") and field in answers["uid-1"].error
    assert _claim_shares(plugin, "uid-1") == [] and _spec(plugin, "uid-1") is None
    assert answers["uid-2"].error == ""  # the other claim of the call is prepared


def test_a_config_whose_requests_are_not_a_list_is_refused_naming_the_field(plugin, claims):
    claims.add(_configured("uid-1", {"requests": "gpu", "opaque": {"driver": DRIVER, "parameters": draclaim.share_config("normal", False)}}))
    error = plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error
    assert "spec.devices.config[0].requests 'gpu' is not allowed" in error


def test_the_pods_the_claim_is_reserved_for_are_booked_with_it_and_released_with_it(plugin, claims):
    reserved = [{"resource": "pods", "name": "trainer", "uid": "pod-1"},
                {"resource": "pods", "name": "helper", "uid": "pod-2"},
                {"apiGroup": "example.com", "resource": "jobs", "name": "j", "uid": "job-1"}]
    claims.add(_configured("uid-1", reserved=reserved))
    plugin.kubelet.prepare(("team-a", "uid-1", "train"))
    booked = plugin.store.prepared_claim("uid-1")
    assert [(p.uid, p.name) for p in booked.pods] == [("pod-2", "helper"), ("pod-1", "trainer")]
    assert plugin.store.prepared_claims() == [booked]
    plugin.kubelet.unprepare(("team-a", "uid-1", "train"))
    db = sqlite3.connect(plugin.store.path)
    assert db.execute("SELECT COUNT(*) FROM claim_pods").fetchone() == (0,)
    db.close()


# ---- device health: v1.DRAResourceHealth.NodeWatchResources -----------------------------------------
def _health(message) -> dict[tuple[str, str], tuple[str, str]]:
    from qgpu_runtime import protos

    names = protos.dra_health().pb2.HealthStatus.Name
    return {(d.device.pool_name, d.device.device_name): (names(d.health), d.message) for d in message.devices}


def test_the_health_stream_starts_with_every_card_of_the_node(plugin):
    channel, stream = plugin.kubelet.watch_health()
    with channel:
        first = next(stream)
        assert _health(first) == {(NODE, "gpu-0"): ("HEALTHY", ""), (NODE, "gpu-1"): ("HEALTHY", "")}
        assert all(d.health_check_timeout_seconds == HEALTH_TIMEOUT_S for d in first.devices)
        assert abs(first.devices[0].last_updated_time - time.time()) < 5
        stream.cancel()


def test_a_card_marked_unhealthy_is_streamed_at_once(plugin):
    channel, stream = plugin.kubelet.watch_health()
    with channel:
        next(stream)
        started = time.monotonic()
        assert plugin.health.mark(1, "XID 79: GPU has fallen off the bus")
        assert _health(next(stream)) == {(NODE, "gpu-0"): ("HEALTHY", ""),
                                         (NODE, "gpu-1"): ("UNHEALTHY", "XID 79: GPU has fallen off the bus")}
        assert time.monotonic() - started < HEALTH_RESEND_S / 2  # the change, not the resend
        stream.cancel()


def test_a_stream_opened_after_the_xid_starts_with_the_card_unhealthy(plugin):
    plugin.health.mark(0, "XID 48")
    channel, stream = plugin.kubelet.watch_health()
    with channel:
        assert _health(next(stream))[(NODE, "gpu-0")] == ("UNHEALTHY", "XID 48")
        stream.cancel()


def test_the_health_is_sent_again_before_kubelets_timeout_without_a_change(root, claims):
    p = Plugin(root, claims, health_resend_s=0.2)
    try:
        channel, stream = p.kubelet.watch_health()
        with channel:
            assert _health(next(stream)) == _health(next(stream))
            stream.cancel()
    finally:
        p.stop()
    assert HEALTH_RESEND_S * 2 < HEALTH_TIMEOUT_S


def test_the_health_stream_ends_when_the_manager_closes_the_health(plugin):
    channel, stream = plugin.kubelet.watch_health()
    with channel:
        next(stream)
        started = time.monotonic()
        plugin.health.close()
        assert list(stream) == []  # a clean end of stream: kubelet's Recv gets EOF
        assert time.monotonic() - started < 2


def test_the_health_stream_ends_when_the_plugin_stops(root, claims):
    import grpc

    p = Plugin(root, claims)
    channel, stream = p.kubelet.watch_health()
    with channel:
        next(stream)
        started = time.monotonic()
        p.stop()
        try:
            rest = list(stream)
        except grpc.RpcError as exc:  # the server went away under the stream
            assert exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        else:
            assert rest == []
        assert time.monotonic() - started < 3


def test_a_stream_kubelet_drops_frees_its_worker(plugin):
    """kubelet going away wakes the stream's wait: more streams than the server's workers come and
    go, and prepare calls still get a worker."""
    for _ in range(12):
        channel, stream = plugin.kubelet.watch_health()
        with channel:
            next(stream)
            stream.cancel()
    assert plugin.kubelet.unprepare(("team-a", "uid-x", "gone"))["uid-x"].error == ""


def test_prepare_is_served_while_many_health_streams_are_open(plugin, claims):
    # Issue 21 §5: each NodeWatchResources stream pinned one of 8 workers; 8 left NodePrepareResources none.
    from streamflood import OPEN, Streams

    from qgpu_runtime import protos
    from qgpu_runtime.node.streams import MAX_STREAMS

    hl = protos.dra_health()
    streams = Streams(f"unix://{plugin.settings.dra_socket}",
                      lambda ch: hl.grpc.DRAResourceHealthStub(ch).NodeWatchResources(hl.pb2.NodeWatchResourcesRequest()), 10)
    try:
        fates = streams.settled()
        assert fates.count(OPEN) == MAX_STREAMS and fates.count("RESOURCE_EXHAUSTED") == 10 - MAX_STREAMS
        claims.add(claim("uid-1"))
        assert plugin.kubelet.prepare(("team-a", "uid-1", "train"))["uid-1"].error == ""
    finally:
        streams.close()
