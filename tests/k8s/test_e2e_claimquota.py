"""The quota declaration of docs/dra.md ("Quota on GPU core and memory") against the real
kube-apiserver v1.37: it stores qgpu's resource names, refuses the unqualified spelling, enforces
nothing for them itself, and the claims it serves back are what webhook/claimquota.py judges."""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract.dra import SHARED_CLASS, WHOLE_CLASS
from qgpu_runtime.webhook.claimquota import CORE_QUOTA, MEMORY_QUOTA, claim_admission


def _quota(name: str, hard: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": name}, "spec": {"hard": hard}}


def _claim(name: str, exactly: dict) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}


def _share(core: int, memory: int) -> dict:
    return {"deviceClassName": SHARED_CLASS, "capacity": {"requests": {"core": str(core), "memory": str(memory)}}}


def test_kube_apiserver_stores_the_qgpu_quota_names(cluster, ns):
    cluster.api.create_namespaced_resource_quota(ns, _quota("gpu", {CORE_QUOTA: "4000", MEMORY_QUOTA: "65536"}))
    # served canonicalised, as every quantity: which is why claimquota.py reads quantities
    assert cluster.api.read_namespaced_resource_quota("gpu", ns).spec.hard == {CORE_QUOTA: "4k", MEMORY_QUOTA: "65536"}


def test_a_claims_capacity_is_served_canonicalised_too(cluster, ns):
    claims = client.CustomObjectsApi(cluster.api_client)
    claims.create_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", _claim("whole", _share(1000, 16384)))
    served = claims.get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", "whole")
    assert served["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"] == {"core": "1k", "memory": "16384"}


def test_kube_apiserver_refuses_a_quota_name_without_a_domain(cluster, ns):
    with pytest.raises(ApiException) as e:
        cluster.api.create_namespaced_resource_quota(ns, _quota("bad", {"requests.core.gpu.qgpu.io": "4000"}))
    assert e.value.status == 422
    assert "must be a standard resource for quota" in json.loads(e.value.body)["message"]


def test_upstream_enforces_nothing_for_them_and_the_served_claims_are_judged_by_qgpu(cluster, ns):
    cluster.api.create_namespaced_resource_quota(ns, _quota("gpu", {CORE_QUOTA: "1000", MEMORY_QUOTA: "16384"}))
    claims = client.CustomObjectsApi(cluster.api_client)
    # kube-apiserver admits claims beyond the qgpu quota: the entries mean only what qgpu enforces
    for name, exactly in (("a", _share(600, 8192)), ("b", {"deviceClassName": WHOLE_CLASS})):
        claims.create_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", _claim(name, exactly))
    cluster.api.create_namespaced_pod(ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"},
                                           "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
    served = claims.list_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims")["items"]
    quotas = [cluster.api_client.sanitize_for_serialization(q) for q in cluster.api.list_namespaced_resource_quota(ns).items]
    stored_a = next(c for c in served if c["metadata"]["name"] == "a")
    assert stored_a["spec"]["devices"]["requests"][0]["exactly"]["allocationMode"] == "ExactCount"  # defaulted by the API
    review = {"uid": "u", "operation": "CREATE", "namespace": ns, "kind": {"group": "resource.k8s.io", "version": "v1",
                                                                          "kind": "ResourceClaim"},
              "object": _claim("c", _share(300, 1024))}
    only_a = [c for c in served if c["metadata"]["name"] == "a"]
    assert claim_admission(review, only_a, quotas, default_memory_mib=16384) == (True, "")
    allowed, message = claim_admission(review, served, quotas, default_memory_mib=16384)
    assert not allowed
    assert f"ResourceClaim {ns}/c: exceeded quota 'gpu'" in message and "used 1600 + requested 300 > hard 1000" in message
