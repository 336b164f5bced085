"""The node's ResourceSlice publisher (node/dra/slices.py) against an in-memory ResourceSlice API
that behaves like the apiserver where the publisher's decisions depend on it: resourceVersions and
conflicts, quantities read back in canonical form, watches that wake on every change."""

from __future__ import annotations

import copy
import threading
import time

import pytest

from qgpu_runtime.contract import dra
from qgpu_runtime.gpu.simulated import SimulatedBackend
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.node.deviceplugin.resources import CATALOG
from qgpu_runtime.node.dra.slices import SlicePublisher, slice_devices
from qgpu_runtime.node.health import CardHealth
from qgpu_runtime.node.manager import ManagerConfig, NodeManager
from qgpu_runtime.node.pods import PodSourceError
from qgpu_runtime.node.store import Store

NODE = "gpu-node-1"
NAME = dra.slice_name(NODE)
CARDS = {i: CardInfo(i, f"GPU-{i}", "Tesla T4", 15360, i) for i in range(2)}


def _canonical(value: str) -> str:
    """The apiserver reads quantities back in canonical form: 1000 is "1k"."""
    return f"{int(value) // 1000}k" if value.isdigit() and int(value) % 1000 == 0 and int(value) > 0 else value


class FakeSlices:
    """An in-memory SliceApi: one resourceVersion counter, 409 on stale writes, waking watches."""

    def __init__(self, node_uid: str = "uid-1") -> None:
        self.node_uids = {NODE: node_uid}
        self.objects: dict[str, dict] = {}
        self.writes: list[str] = []
        self.version = 0
        self.fail_next = 0  # calls that fail with a transient error before the API answers again
        self._changed = threading.Condition()

    def _bump(self) -> str:
        self.version += 1
        self._changed.notify_all()
        return str(self.version)

    def _maybe_fail(self) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise PodSourceError("reading ResourceSlice: HTTP 503 unavailable", transient=True)

    def node_uid(self, node: str) -> str:
        self._maybe_fail()
        return self.node_uids[node]

    def read_slice(self, name: str) -> dict | None:
        self._maybe_fail()
        with self._changed:
            obj = self.objects.get(name)
            return copy.deepcopy(obj) if obj is not None else None

    def _store(self, body: dict) -> dict:
        obj = copy.deepcopy(body)
        for device in obj["spec"]["devices"]:
            for capacity in device.get("capacity", {}).values():
                capacity["value"] = _canonical(capacity["value"])
        obj["metadata"]["resourceVersion"] = self._bump()
        self.objects[obj["metadata"]["name"]] = obj
        return copy.deepcopy(obj)

    def create_slice(self, body: dict) -> dict:
        self._maybe_fail()
        with self._changed:
            if body["metadata"]["name"] in self.objects:
                raise PodSourceError("creating ResourceSlice: HTTP 409 already exists", transient=False)
            self.writes.append("create")
            return self._store(body)

    def replace_slice(self, name: str, body: dict) -> dict:
        self._maybe_fail()
        with self._changed:
            current = self.objects.get(name)
            if current is None or current["metadata"]["resourceVersion"] != body["metadata"].get("resourceVersion"):
                raise PodSourceError("updating ResourceSlice: HTTP 409 conflict", transient=False)
            self.writes.append("replace")
            return self._store(body)

    def delete(self, name: str) -> None:
        """Someone else (kubelet at start, an operator) deletes the slice."""
        with self._changed:
            del self.objects[name]
            self._bump()

    def edit(self, name: str, change) -> None:
        with self._changed:
            change(self.objects[name])
            self.objects[name]["metadata"]["resourceVersion"] = self._bump()

    def watch_slice(self, name: str, resource_version: str, timeout_s: float, stop: threading.Event) -> str | None:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.version <= int(resource_version or 0):
                if stop.is_set() or time.monotonic() >= deadline:
                    return None
                self._changed.wait(min(0.05, deadline - time.monotonic()))
            return "MODIFIED" if name in self.objects else "DELETED"

    def close(self) -> None:
        with self._changed:
            self._changed.notify_all()


def _publisher(api: FakeSlices, health: CardHealth | None = None) -> SlicePublisher:
    return SlicePublisher(api, NODE, CARDS, health or CardHealth(CARDS), lambda: Policy.FIXED_SHARE, retry_max_s=0.2)


def test_the_first_sync_creates_one_slice_with_one_shareable_device_per_card_owned_by_the_node():
    api = FakeSlices()
    assert _publisher(api).sync() == "created"
    obj = api.objects[NAME]
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "uid-1", "controller": True}]
    spec = obj["spec"]
    assert (spec["driver"], spec["nodeName"]) == (dra.DRIVER, NODE)
    assert spec["pool"] == {"name": dra.pool_name(NODE), "generation": 1, "resourceSliceCount": 1}
    assert [d["name"] for d in spec["devices"]] == ["gpu-0", "gpu-1"]
    assert all(d["allowMultipleAllocations"] and "taints" not in d for d in spec["devices"])
    assert spec["devices"][1]["attributes"][dra.ATTR_POLICY] == {"string": "fixed-share"}


def test_an_unchanged_node_writes_nothing_although_the_apiserver_rewrote_its_quantities():
    api = FakeSlices()
    publisher = _publisher(api)
    publisher.sync()
    assert api.objects[NAME]["spec"]["devices"][0]["capacity"][dra.CORE]["value"] == "1k"
    assert [publisher.sync(), publisher.sync()] == ["unchanged", "unchanged"]
    assert api.writes == ["create"]


def test_an_unhealthy_card_is_tainted_no_schedule_and_the_pool_generation_moves():
    api, health = FakeSlices(), CardHealth(CARDS)
    publisher = _publisher(api, health)
    publisher.sync()
    health.mark(1, "XID 79: GPU has fallen off the bus")
    assert publisher.sync() == "updated"
    devices = api.objects[NAME]["spec"]["devices"]
    assert "taints" not in devices[0]
    assert devices[1]["taints"] == [{"key": dra.UNHEALTHY_TAINT, "value": "XID-79-GPU-has-fallen-off-the-bus",
                                     "effect": "NoSchedule"}]
    assert api.objects[NAME]["spec"]["pool"]["generation"] == 2
    assert publisher.sync() == "unchanged"


def test_with_no_execute_chosen_the_unhealthy_cards_taint_evicts_and_an_unknown_effect_is_refused():
    api, health = FakeSlices(), CardHealth(CARDS)
    publisher = SlicePublisher(api, NODE, CARDS, health, lambda: Policy.FIXED_SHARE, retry_max_s=0.2, unhealthy_effect="NoExecute")
    health.mark(0, "XID 48")
    publisher.sync()
    assert api.objects[NAME]["spec"]["devices"][0]["taints"][0]["effect"] == "NoExecute"
    with pytest.raises(ValueError, match=r"--dra-unhealthy-effect: 'Evict' is not allowed: must be one of NoSchedule, NoExecute"):
        SlicePublisher(api, NODE, CARDS, health, lambda: Policy.FIXED_SHARE, unhealthy_effect="Evict")


def test_a_deleted_slice_is_created_again_with_a_higher_generation_and_the_nodes_current_uid():
    api, health = FakeSlices(), CardHealth(CARDS)
    publisher = _publisher(api, health)
    publisher.sync()
    health.mark(0, "XID 48")
    publisher.sync()
    api.delete(NAME)
    api.node_uids[NODE] = "uid-2"  # the Node was deleted and registered again
    assert publisher.sync() == "created"
    obj = api.objects[NAME]
    assert obj["spec"]["pool"]["generation"] == 3
    assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-2"


def test_a_manager_restarted_continues_the_generation_of_the_slice_it_finds():
    api = FakeSlices()
    _publisher(api).sync()
    health = CardHealth(CARDS)
    health.mark(0, "XID 48")
    _publisher(api, health).sync()
    assert api.objects[NAME]["spec"]["pool"]["generation"] == 2


def test_a_slice_someone_edited_is_put_back():
    api = FakeSlices()
    publisher = _publisher(api)
    publisher.sync()
    api.edit(NAME, lambda obj: obj["spec"]["devices"].pop())
    assert publisher.sync() == "updated"
    assert [d["name"] for d in api.objects[NAME]["spec"]["devices"]] == ["gpu-0", "gpu-1"]


def test_a_write_that_lost_a_race_is_refused_with_the_apiservers_conflict():
    api = FakeSlices()
    publisher = _publisher(api)
    publisher.sync()
    api.edit(NAME, lambda obj: obj["spec"]["devices"].pop())
    real_read = api.read_slice

    def stale_read(name):
        obj = real_read(name)
        api.edit(NAME, lambda o: None)  # someone writes between our read and our write
        return obj

    api.read_slice = stale_read
    with pytest.raises(PodSourceError, match="409"):
        publisher.sync()


def test_publish_logs_a_failure_instead_of_raising(caplog):
    api = FakeSlices()
    api.fail_next = 1
    assert _publisher(api).publish() is False
    assert "503" in caplog.text and NAME in caplog.text


def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_serve_republishes_a_deleted_slice_and_stops_when_told():
    api = FakeSlices()
    publisher = _publisher(api)
    stop = threading.Event()
    thread = threading.Thread(target=publisher.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        _wait(lambda: NAME in api.objects)
        api.delete(NAME)
        _wait(lambda: NAME in api.objects)
        assert api.writes == ["create", "create"]
        assert api.objects[NAME]["spec"]["pool"]["generation"] == 2
    finally:
        stop.set()
        publisher.close()
        thread.join(2)
    assert not thread.is_alive()


def test_serve_keeps_trying_while_the_apiserver_is_away():
    api = FakeSlices()
    api.fail_next = 3
    publisher = _publisher(api)
    stop = threading.Event()
    thread = threading.Thread(target=publisher.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        _wait(lambda: NAME in api.objects)
    finally:
        stop.set()
        publisher.close()
        thread.join(2)


def test_slice_devices_are_the_contracts_devices_in_card_order():
    devices = slice_devices({1: CARDS[1], 0: CARDS[0]}, {}, Policy.BEST_EFFORT)
    assert devices == [dra.slice_device(CARDS[i], "best-effort") for i in (0, 1)]


@pytest.fixture()
def manager_parts(tmp_path):
    store = Store(tmp_path / "meta.db")
    yield tmp_path, store
    store.close()


class _Pods:
    def pods_on_node(self, node):
        return []

    def patch_pod_annotations(self, namespace, name, values):
        pass

    def patch_node(self, node, labels, annotations):
        pass

    def patch_node_capacity(self, node, capacity):
        pass

    def node_labels(self, node):
        return {}

    def record_event(self, *args):
        pass

    def set_node_condition(self, node, condition):
        pass

    def record_node_event(self, node, event_type, reason, message):
        pass


def _config(tmp_path, dra_on: bool) -> ManagerConfig:
    return ManagerConfig(NODE, (CATALOG["tke.cloud.tencent.com/qgpu-core"],), plugin_dir=tmp_path / "plugins",
                         state_dir=tmp_path / "state", dra=dra_on)


def test_the_manager_with_dra_retaints_the_slice_when_a_card_turns_unhealthy(manager_parts):
    tmp_path, store = manager_parts
    api = FakeSlices()
    manager = NodeManager(_config(tmp_path, True), SimulatedBackend(tuple(CARDS.values())), store, _Pods(), slice_api=api)
    assert manager.slices is not None
    manager.slices.sync()
    manager.mark_unhealthy(0, "XID 79")
    assert api.objects[NAME]["spec"]["devices"][0]["taints"][0]["key"] == dra.UNHEALTHY_TAINT
    manager.mark_healthy(0, "reset")
    assert not any(d.get("taints") for d in api.objects[NAME]["spec"]["devices"])


def test_the_manager_refuses_dra_without_an_api_to_write_slices_to(manager_parts):
    tmp_path, store = manager_parts
    with pytest.raises(ValueError, match="--dra"):
        NodeManager(_config(tmp_path, True), SimulatedBackend(tuple(CARDS.values())), store, _Pods())


def test_the_manager_without_dra_publishes_no_slice(manager_parts):
    tmp_path, store = manager_parts
    manager = NodeManager(_config(tmp_path, False), SimulatedBackend(tuple(CARDS.values())), store, _Pods(),
                          slice_api=FakeSlices())
    assert manager.slices is None


def test_manager_serve_refuses_dra_with_a_pods_file(tmp_path, caplog):
    from qgpu_runtime.cli import main

    (tmp_path / "pods.json").write_text('{"items": []}')
    code = main(["manager", "serve", "--nodename", NODE, "--dra", "--pods-file", str(tmp_path / "pods.json"),
                 "--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G", "--dbfile", str(tmp_path / "meta.db"),
                 "--metrics-port", "-1"])
    assert code == 2 and "--dra reads ResourceClaims and publishes ResourceSlices through the Kubernetes API" in caplog.text
