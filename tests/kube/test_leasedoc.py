"""The Lease-document primitive against a fake CoordinationV1Api that checks resourceVersions the
way the apiserver does (tests/k8s/test_e2e_leasedoc.py runs the same against the real one)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.kube.errors import ApiError, Conflict, Unavailable
from qgpu_runtime.kube.leasedoc import LeaseDocuments, LeaseText

NOTE = "example.com/document"
LABELS = {"app.kubernetes.io/managed-by": "test"}
T = (1.0, 1.0)


class Response:
    def __init__(self, doc: Any):
        self.data = json.dumps(doc).encode()


class FakeLeases:
    """Leases of one namespace; a create of an existing one or a replace on a stale version is a 409."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.failures: list[BaseException] = []
        self.calls = 0

    def _next(self) -> None:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)

    def _store(self, name: str, body: dict[str, Any]) -> Response:
        self.version += 1
        self.leases[name] = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        return Response(self.leases[name])

    def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> Response:
        self._next()
        if name not in self.leases:
            raise ApiException(status=404, reason="Not Found")
        return Response(self.leases[name])

    def create_namespaced_lease(self, namespace: str, body: dict[str, Any], **_: Any) -> Response:
        self._next()
        name = body["metadata"]["name"]
        if name in self.leases:
            raise ApiException(status=409, reason="AlreadyExists")
        return self._store(name, body)

    def replace_namespaced_lease(self, name: str, namespace: str, body: dict[str, Any], **_: Any) -> Response:
        self._next()
        if name not in self.leases:
            raise ApiException(status=404, reason="Not Found")
        if body["metadata"].get("resourceVersion") != self.leases[name]["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        return self._store(name, body)


@pytest.fixture
def api() -> FakeLeases:
    return FakeLeases()


def test_an_absent_lease_reads_as_none_and_a_write_without_version_creates_it(api):
    docs = LeaseDocuments(api, "qgpu", NOTE, LABELS)  # type: ignore[arg-type]
    assert docs.read("doc-a", timeout=T) is None
    version = docs.write("doc-a", '{"v":1}', None, timeout=T)
    assert docs.read("doc-a", timeout=T) == LeaseText('{"v":1}', version)
    stored = api.leases["doc-a"]
    assert stored["kind"] == "Lease" and stored["spec"] == {}
    assert stored["metadata"]["labels"] == LABELS and stored["metadata"]["namespace"] == "qgpu"


def test_a_write_on_the_version_read_replaces_and_returns_the_new_version(api):
    docs = LeaseDocuments(api, "qgpu", NOTE, LABELS)  # type: ignore[arg-type]
    first = docs.write("doc-a", "one", None, timeout=T)
    second = docs.write("doc-a", "two", first, timeout=T)
    assert second != first and docs.read("doc-a", timeout=T) == LeaseText("two", second)


def test_of_two_writers_on_one_version_the_second_gets_a_conflict(api):
    mine, theirs = (LeaseDocuments(api, "qgpu", NOTE, LABELS) for _ in range(2))  # type: ignore[arg-type]
    version = mine.write("doc-a", "zero", None, timeout=T)
    theirs.write("doc-a", "theirs", version, timeout=T)
    with pytest.raises(Conflict) as lost:
        mine.write("doc-a", "mine", version, timeout=T)
    assert lost.value.status == 409
    assert mine.read("doc-a", timeout=T).text == "theirs"  # type: ignore[union-attr]


def test_a_create_racing_another_create_is_a_conflict(api):
    LeaseDocuments(api, "qgpu", NOTE, LABELS).write("doc-a", "first", None, timeout=T)  # type: ignore[arg-type]
    with pytest.raises(Conflict):
        LeaseDocuments(api, "qgpu", NOTE, LABELS).write("doc-a", "second", None, timeout=T)  # type: ignore[arg-type]


def test_a_lease_without_the_annotation_reads_as_no_text(api):
    api.leases["bare"] = {"metadata": {"name": "bare", "resourceVersion": "7", "annotations": {"other": "x"}},
                          "spec": {"holderIdentity": "someone-else"}}
    assert LeaseDocuments(api, "qgpu", NOTE, LABELS).read("bare", timeout=T) == LeaseText(None, "7")  # type: ignore[arg-type]


def test_transient_failures_are_retried_only_when_asked_and_others_raised_as_mapped(api):
    docs = LeaseDocuments(api, "qgpu", NOTE, LABELS)  # type: ignore[arg-type]
    api.failures = [ApiException(status=503, reason="Service Unavailable")]
    with pytest.raises(Unavailable):
        docs.read("doc-a", timeout=T)  # one attempt by default (the webhook's budget decides)
    api.failures = [ApiException(status=503, reason="Service Unavailable"), ConnectionResetError("reset")]
    assert docs.write("doc-a", "x", None, timeout=T, attempts=3)
    assert api.calls == 4
    api.failures = [ApiException(status=403, reason="Forbidden")]
    with pytest.raises(ApiError) as refused:
        docs.read("doc-a", timeout=T, attempts=3)
    assert refused.value.status == 403 and api.calls == 5
