"""Any wrong-typed field anywhere in an AdmissionReview is a 400 naming it: never an exception
(which the HTTP layer would turn into a 500)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings

from qgpu_runtime.webhook import cli
from qgpu_runtime.webhook.admission import WebhookConfig
from tests.extender.test_malformed_bodies import POD
from tests.jsonmutation import mutations

REVIEW = {
    "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
    "request": {"uid": "r-1", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE",
                "namespace": "ns", "object": POD},
}
ROUTES = cli.routes(WebhookConfig("qgpu-scheduler"))


def answer(route: str, doc: object) -> tuple[int, object]:
    status, body = ROUTES.post[route]("", json.dumps(doc).encode())
    if status != 200:
        assert status == 400 and body["error"], body
    return status, body


def with_object(pod: object) -> dict:
    return {**REVIEW, "request": {**REVIEW["request"], "object": pod}}


@pytest.mark.parametrize("route", ["/validate", "/mutate"])
@pytest.mark.parametrize("spec,field", [
    ({"containers": 5}, "AdmissionReview.request.object.spec.containers=5"),
    ({"containers": [{"name": "c", "resources": []}]}, "AdmissionReview.request.object.spec.containers[0].resources=[]"),
    ({"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 5}}}]},
     "AdmissionReview.request.object.spec.containers[0].resources.limits['nvidia.com/gpu']=5"),
])
def test_wrong_typed_pod_fields_are_400_naming_the_field(route, spec, field):
    status, body = answer(route, with_object({**POD, "spec": spec}))
    assert status == 400 and body["error"].startswith(field), body


@pytest.mark.parametrize("route", ["/validate", "/mutate"])
def test_a_request_kind_that_is_not_an_object_is_400(route):
    status, body = answer(route, {**REVIEW, "request": {**REVIEW["request"], "kind": "Pod"}})
    assert status == 400 and body["error"].startswith("AdmissionReview.request.kind=Pod: must be an object"), body


@settings(max_examples=400, deadline=None)
@given(doc=mutations(REVIEW))
def test_structure_mutated_reviews_are_validated_or_refused(doc):
    answer("/validate", doc)


@settings(max_examples=400, deadline=None)
@given(doc=mutations(REVIEW))
def test_structure_mutated_reviews_are_mutated_or_refused(doc):
    answer("/mutate", doc)


def test_review_bodies_are_limited_to_one_object_of_the_apiservers_largest():
    """CREATE-only webhooks get one object (oldObject is null): 3 MiB and an envelope."""
    cap = 3 * 1024 * 1024 + 64 * 1024
    assert ROUTES.body_limits == {"/validate": cap, "/mutate": cap}
    assert ROUTES.token_limits == {"/validate": 256 * 1024, "/mutate": 256 * 1024}
    assert ROUTES.open_paths == frozenset({"/healthz", "/readyz"})
