"""The Lease-document primitive (kube/leasedoc.py) and the error mapping against the real
apiserver: what the fake in tests/kube/test_leasedoc.py assumes of resourceVersions, 404 and 409."""

from __future__ import annotations

import pytest
from kubernetes import client

from qgpu_runtime.kube.client import api_client
from qgpu_runtime.kube.errors import ApiError, Conflict, NotFound, call
from qgpu_runtime.kube.leasedoc import LeaseDocuments, LeaseText

NOTE = "qgpu.io/test-document"
LABELS = {"app.kubernetes.io/managed-by": "qgpu-test"}
T = (3.0, 10.0)


@pytest.fixture
def leases(cluster) -> client.CoordinationV1Api:
    return client.CoordinationV1Api(api_client(str(cluster.cp.admin_kubeconfig)))


def test_read_absent_create_replace_and_conflict_on_a_stale_version(leases, ns):
    mine, theirs = LeaseDocuments(leases, ns, NOTE, LABELS), LeaseDocuments(leases, ns, NOTE, LABELS)
    assert mine.read("doc", timeout=T) is None
    created = mine.write("doc", "one", None, timeout=T)
    assert created and mine.read("doc", timeout=T) == LeaseText("one", created)
    with pytest.raises(Conflict) as exists:
        theirs.write("doc", "also one", None, timeout=T)  # a create racing the first: 409 AlreadyExists
    assert exists.value.message and "already exists" in exists.value.message
    replaced = theirs.write("doc", "two", created, timeout=T)
    with pytest.raises(Conflict) as stale:
        mine.write("doc", "mine", created, timeout=T)  # read at `created`, written over since
    assert stale.value.status == 409 and stale.value.message
    assert mine.read("doc", timeout=T) == LeaseText("two", replaced)
    stored = leases.read_namespaced_lease("doc", ns)
    assert stored.metadata.labels == LABELS and stored.metadata.annotations == {NOTE: "two"}


def test_the_apiservers_refusals_map_to_their_classes_with_its_message(leases, ns):
    with pytest.raises(NotFound) as missing:
        call(leases.read_namespaced_lease, "nobody", ns)
    assert missing.value.message == 'leases.coordination.k8s.io "nobody" not found'
    with pytest.raises(ApiError) as invalid:
        call(leases.create_namespaced_lease, ns, {"metadata": {"name": "Not_A_Name"}, "spec": {}})
    assert invalid.value.status == 422 and not isinstance(invalid.value, (NotFound, Conflict))
    assert "Not_A_Name" in str(invalid.value) and str(invalid.value).startswith("422 Unprocessable Entity: ")
