"""Admission review: invalid GPU requests are denied with the parser's words; valid ones are
completed (requests/limits, schedulerName, xgn toleration)."""

from __future__ import annotations

import base64
import json

import pytest

from qgpu_runtime.webhook.admission import XGN_TOLERATION, ReviewError, WebhookConfig, mutate, validate


def review(pod: dict, operation: str = "CREATE", kind: str = "Pod") -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "r-1", "kind": {"group": "", "version": "v1", "kind": kind},
                                   "operation": operation, "namespace": "ns", "object": pod}}).encode()


def pod(limits: dict | None = None, requests: dict | None = None, **spec: object) -> dict:
    resources = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    return {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "resources": resources}], **spec}}


def patch_of(answer: dict) -> list:
    response = answer["response"]
    return json.loads(base64.b64decode(response["patch"])) if "patch" in response else []


def test_invalid_request_is_denied_with_every_problem():
    answer = validate(review(pod({"tke.cloud.tencent.com/qgpu-core": "150"})), WebhookConfig())
    response = answer["response"]
    assert response["uid"] == "r-1" and response["allowed"] is False
    assert "tke.cloud.tencent.com/qgpu-core=150" in response["status"]["message"]
    assert "multiple of 100" in response["status"]["message"]


def test_valid_and_gpu_free_pods_are_allowed():
    config = WebhookConfig()
    assert validate(review(pod({"nvidia.com/gpu": "1"})), config)["response"]["allowed"] is True
    assert validate(review(pod({"cpu": "1"})), config)["response"]["allowed"] is True
    assert validate(review({"metadata": {}}, kind="ConfigMap"), config)["response"]["allowed"] is True


def test_mutate_fills_requests_from_limits_and_limits_from_requests():
    ops = patch_of(mutate(review(pod({"tke.cloud.tencent.com/qgpu-core": "30", "cpu": "1"},
                                     {"tke.cloud.tencent.com/qgpu-memory": "4"})), WebhookConfig()))
    assert {"op": "add", "path": "/spec/containers/0/resources/requests/tke.cloud.tencent.com~1qgpu-core", "value": "30"} in ops
    assert {"op": "add", "path": "/spec/containers/0/resources/limits/tke.cloud.tencent.com~1qgpu-memory", "value": "4"} in ops
    assert not any("cpu" in op["path"] for op in ops)


def test_mutate_adds_missing_sections_whole():
    ops = patch_of(mutate(review(pod({"nvidia.com/gpu": "2"})), WebhookConfig()))
    assert {"op": "add", "path": "/spec/containers/0/resources/requests", "value": {"nvidia.com/gpu": "2"}} in ops


def test_scheduler_name_is_set_only_for_gpu_pods_that_kept_the_default():
    config = WebhookConfig(scheduler_name="qgpu-scheduler")
    ops = patch_of(mutate(review(pod({"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "1"})), config))
    assert ops == [{"op": "add", "path": "/spec/schedulerName", "value": "qgpu-scheduler"},
                   {"op": "add", "path": "/spec/tolerations", "value": [XGN_TOLERATION]}]
    assert patch_of(mutate(review(pod({"cpu": "1"})), config)) == []
    custom = patch_of(mutate(review(pod({"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "1"}, schedulerName="mine")), config))
    assert not any(op["path"] == "/spec/schedulerName" for op in custom)


def test_xgn_toleration_is_added_once_for_exclusive_requests_only():
    shared = pod({"tensorstack.dev/nvidia-gpu-percent": "50"}, {"tensorstack.dev/nvidia-gpu-percent": "50"})
    assert patch_of(mutate(review(shared), WebhookConfig())) == []
    whole = pod({"tensorstack.dev/nvidia-gpu": "1"}, {"tensorstack.dev/nvidia-gpu": "1"},
                tolerations=[{"key": "other", "operator": "Exists"}])
    assert patch_of(mutate(review(whole), WebhookConfig())) == [{"op": "add", "path": "/spec/tolerations/-", "value": XGN_TOLERATION}]
    already = pod({"tensorstack.dev/nvidia-gpu": "1"}, {"tensorstack.dev/nvidia-gpu": "1"}, tolerations=[dict(XGN_TOLERATION)])
    assert patch_of(mutate(review(already), WebhookConfig())) == []


def test_a_pod_listing_255_kib_of_gpu_model_names_is_refused_at_admission_in_a_short_message():
    """The apiserver takes 256 KiB of annotations: 85,000 characters of names in each of
    qgpu.io/gpu-model, HAMi's use-gputype and nouse-gputype (~16,000 names each). Admitted before,
    each parse of the pod made ~3.2 MiB of strings that the extender kept per pod version."""
    def names(separator: str) -> str:
        out, n = [], 0
        while sum(map(len, out)) + len(out) < 85_000:
            out.append(f"{n:x}")
            n += 1
        return separator.join(out)

    p = pod({"tke.cloud.tencent.com/qgpu-core": "10", "tke.cloud.tencent.com/qgpu-memory": "1"})
    p["metadata"]["annotations"] = {"qgpu.io/gpu-model": names("|"), "nvidia.com/use-gputype": names(","),
                                    "nvidia.com/nouse-gputype": names(",")}
    response = validate(review(p), WebhookConfig())["response"]
    assert response["allowed"] is False and response["status"]["code"] == 422
    message = response["status"]["message"]
    assert message.startswith("qgpu: pod: annotation qgpu.io/gpu-model=0|1|2|3|4|5|6|7|8|9|a|b|c|d|e|f|10|11|12... "
                              "(85001 characters): lists 17874 GPU model names, at most 16 are allowed")
    for key in ("nvidia.com/use-gputype", "nvidia.com/nouse-gputype"):
        assert f"annotation {key}=0,1,2,3,4,5,6,7,8,9,a,b,c,d,e,f,10,11,12... (85001 characters): lists 17874" in message
    assert len(message) < 1024
    assert patch_of(mutate(review(p), WebhookConfig())) == []  # left to the validator, as every refused pod


def test_mutate_leaves_invalid_pods_to_the_validator():
    assert patch_of(mutate(review(pod({"tke.cloud.tencent.com/qgpu-core": "150"})), WebhookConfig())) == []


@pytest.mark.parametrize("body, message", [
    (b"nope", "not JSON"),
    (json.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}).encode(), "only admission.k8s.io/v1"),
    (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}).encode(), "non-empty uid"),
])
def test_unreadable_reviews_are_client_errors(body, message):
    with pytest.raises(ReviewError, match=message):
        validate(body, WebhookConfig())
