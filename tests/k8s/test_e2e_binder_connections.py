"""Binds reuse the extender's pooled apiserver connection.

A response read with ``_preload_content=False`` and never drained keeps its connection out of
urllib3's pool, so every bind used to open a new TCP + TLS connection to kube-apiserver (profiling
under a burst showed a third of the extender's time in handshakes). Sequential binds must now
share one connection.
"""

from __future__ import annotations

import pytest
from kubernetes import client

from qgpu_runtime.extender.binder import Binder
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.extender.commitments import LeaseCommitments
from qgpu_runtime.kube.client import api_client
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.placement.policies import make_policy
from tests.k8s.kubeobjects import cards, gpu_node, gpu_pod, read_pod, record
from tests.recordkeys import SIGNER, VERIFIER

PODS = 12


@pytest.mark.parametrize("commitments", [False, True], ids=["plain", "node-commitments"])
def test_sequential_binds_share_one_apiserver_connection(cluster, ns, label, commitments):
    """With node commitments each bind also reads (the first time) and writes the node's Lease on
    the same connection."""
    node = f"{ns}-conn-{int(commitments)}"
    gpu_node(cluster.api, node, cards(4, node=node), label)
    api = client.CoreV1Api(api_client(str(cluster.cp.admin_kubeconfig)))
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([client.ApiClient().sanitize_for_serialization(cluster.api.read_node(node))])
    cache.replace_pods([])
    store = LeaseCommitments(client.CoordinationV1Api(api.api_client), ns) if commitments else None
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=store, signer=SIGNER)
    uids = {}
    for i in range(PODS):
        # a scheduler name nobody serves: only this test binds these pods
        created = cluster.api.create_namespaced_pod(ns, gpu_pod(f"p{i:02d}", {"tke.cloud.tencent.com/qgpu-core": 20,
                                                                          "tke.cloud.tencent.com/qgpu-memory": 2},
                                                                selector=label, scheduler_name="nobody"))
        uids[f"p{i:02d}"] = created.metadata.uid
    pools = api.api_client.rest_client.pool_manager.pools
    opened_before = sum(pools[key].num_connections for key in pools.keys())
    for name, uid in uids.items():
        binder.bind(ns, name, uid, node)
    opened = sum(pools[key].num_connections for key in pools.keys()) - opened_before
    assert opened <= 1, f"{PODS} sequential binds opened {opened} new apiserver connections"
    for name in uids:
        pod = read_pod(cluster.api, ns, name)
        assert pod["spec"]["nodeName"] == node and record(pod).node == node
