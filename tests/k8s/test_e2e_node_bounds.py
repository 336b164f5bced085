"""Issue 21 §4 and §7 under the real control plane: one node's hostile inventory hurts only that
node, and an apiserver the extender cannot reach is a refusal in its answers, never a 500.

The hostile node is written as its node manager's token could write it (the admission policy lets
a node's manager set its own ``qgpu.io/gpus``); the test removes it after itself, as it lives in
the session's shared cluster. The outage is one extender's: its kubeconfig goes through a TCP relay
to the real apiserver, and the relay is cut once the extender has synced."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import extender_server
from tests.k8s.kubeobjects import bound, cards, gpu_node, gpu_pod, read_pod, scheduling_failure, wait_for
from tests.k8s.test_e2e_extender_trust import NOBODY, bind_args, call

QGPU_CORE = "tke.cloud.tencent.com/qgpu-core"
QGPU_MEMORY = "tke.cloud.tencent.com/qgpu-memory"


def test_a_node_with_a_hostile_inventory_hurts_only_itself(cluster, ns, label):
    good, bad = f"{ns}-good", f"{ns}-bad"
    gpu_node(cluster.api, good, cards(1, node=good), label)
    gpu_node(cluster.api, bad, cards(2, node=bad), label)
    hostile = [{"index": 0, "uuid": "GPU-x", "model": "V100", "memory_mib": 2**64}]
    cluster.api.patch_node(bad, {"metadata": {"annotations": {"qgpu.io/gpus": json.dumps(hostile)}}})
    try:
        cluster.api.create_namespaced_pod(ns, gpu_pod("fits", {QGPU_CORE: 30, QGPU_MEMORY: 5}, selector=label))
        assert bound(cluster.api, ns, "fits")["spec"]["nodeName"] == good
        # one more than the good node's single card can take: only the hostile node is left, and it says why
        cluster.api.create_namespaced_pod(ns, gpu_pod("whole", {QGPU_CORE: 100}, selector=label))
        event = scheduling_failure(cluster.api, ns, "whole", "qgpu refused this node's data")
        assert "memory_mib=18446744073709551616: must be an integer from 1 to 1048576" in event["message"]
        assert not read_pod(cluster.api, ns, "whole")["spec"].get("nodeName")
    finally:
        cluster.api.delete_node(bad)


class Relay:
    """A TCP relay to ``upstream``; :meth:`cut` closes it and every connection through it."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(self.upstream)
            except OSError:
                return
            with self.lock:
                if self.closed:
                    client.close()
                    server.close()
                    return
                self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        with self.lock:
            self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (close alone does not)
        except OSError:
            pass
        self.listener.close()
        with self.lock:
            for s in self.sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


def _kubeconfig_through(cluster: Any, relay: Relay, into: Path) -> Path:
    text = Path(cluster.cp.admin_kubeconfig).read_text()
    port = cluster.cp.server.rsplit(":", 1)[1]
    into.write_text(text.replace(f"https://127.0.0.1:{port}", f"https://127.0.0.1:{relay.port}"))
    return into


def test_an_unreachable_apiserver_is_a_refusal_in_the_answer(cluster, ns, label, tmp_path):
    node = f"{ns}-a"
    gpu_node(cluster.api, node, cards(1, node=node), label)
    relay = Relay(("127.0.0.1", int(cluster.cp.server.rsplit(":", 1)[1])))
    extender = extender_server(cluster.cp, tls=False, kubeconfig=_kubeconfig_through(cluster, relay, tmp_path / "kc"),
                               name="qgpu-extender-outage")
    extender.start()  # ready: its node and pod caches synced through the relay
    try:
        cluster.api.create_namespaced_pod(ns, gpu_pod("cpu", {"cpu": "100m"}, selector=label, scheduler_name=NOBODY))
        cpu = read_pod(cluster.api, ns, "cpu")
        wait_for("the extender's watch to deliver the pod", lambda: call(
            extender, "filter", {"Pod": cpu, "NodeNames": [node]}, None)[1].get("NodeNames") == [node])
        relay.cut()
        cluster.api.create_namespaced_pod(ns, gpu_pod("gpu", {QGPU_CORE: 30, QGPU_MEMORY: 2}, selector=label, scheduler_name=NOBODY))
        gpu = read_pod(cluster.api, ns, "gpu")  # created after the cut: the extender must ask the apiserver
        status, doc = call(extender, "filter", {"Pod": gpu, "NodeNames": [node]}, None)
        assert status == 200 and "the apiserver cannot be reached" in doc["Error"], (status, doc)
        status, doc = call(extender, "prioritize", {"Pod": gpu, "NodeNames": [node]}, None)
        assert (status, doc) == (200, [])
        status, doc = call(extender, "bind", bind_args(cpu, node), None)
        assert status == 200 and "the apiserver cannot be reached" in doc["Error"], (status, doc)
    finally:
        extender.stop()
        relay.cut()
