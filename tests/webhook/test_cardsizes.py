"""DRA pools serve T9k percent pods with the role defaults (issue 22 §4): the card sizes come from
the ResourceSlices the pools publish (webhook/cardsizes.py), not from a list kept by hand. Pure
here; served against the real kube-apiserver in tests/k8s/test_e2e_webhook_card_sizes.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from qgpu_runtime.contract import dra
from qgpu_runtime.webhook.admission import WebhookConfig
from qgpu_runtime.webhook.cardsizes import published_sizes
from qgpu_runtime.webhook.dra import CardSizesUnavailable, DraConfig, DraRefusal, convert, mutate_dra
from tests.k8s.kubeobjects import cards

PERCENT = {"tensorstack.dev/nvidia-gpu-percent": "25"}


def slice_of(node: str, *memories: int, driver: str = dra.DRIVER) -> dict[str, Any]:
    devices = [dra.slice_device(card, "fixed-share") for m in memories for card in cards(1, memory_mib=m, node=f"{node}-{m}")]
    for i, device in enumerate(devices):
        device["name"] = f"gpu-{i}"
    return {"spec": {"driver": driver, "nodeName": node, "pool": {"name": node}, "devices": devices}}


def percent_pod() -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [{"name": "c", "image": "busybox", "resources": {"limits": dict(PERCENT)}}]}}


def subrequest_sizes(config: DraConfig) -> list[str]:
    (template,) = convert(percent_pod(), config).templates
    (request,) = template.claim_spec["devices"]["requests"]
    return [s["name"] for s in request["firstAvailable"]]


def test_mixed_card_sizes_of_the_pools_are_one_alternative_each_smallest_first():
    assert published_sizes([slice_of("a", 32768, 15360), slice_of("b", 15360), slice_of("c", 81920)]).sizes == (15360, 32768, 81920)


def test_other_drivers_slices_and_devices_without_a_sane_memory_attribute_are_left_out():
    bad = slice_of("a", 15360)
    bad["spec"]["devices"][0]["attributes"][dra.ATTR_MEMORY_MIB] = {"int": 10**12}
    assert published_sizes([bad, slice_of("b", 24576, driver="gpu.example.com")]).sizes == ()


def test_one_node_publishing_many_sizes_cannot_crowd_out_what_the_other_nodes_publish():
    honest = [slice_of(f"n{i}", 15360, 32768) for i in range(2)]
    liar = slice_of("liar", *[1024 * (20 + i) for i in range(12)])
    found = published_sizes([liar, *honest])
    assert len(found.sizes) == 8 and {15360, 32768} <= set(found.sizes)
    assert len(found.left_out) == 6 and not {15360, 32768} & set(found.left_out)


def test_percent_pods_use_the_published_sizes_when_no_flag_gives_them():
    published = DraConfig(published=lambda: (32768, 15360))
    assert subrequest_sizes(published) == ["mib15360", "mib32768"]
    # the flag, when given, overrides what is published
    assert subrequest_sizes(DraConfig(card_memory_mib=(24576,), published=lambda: (32768,))) == ["mib24576"]


def test_a_percent_pod_before_any_card_is_published_is_refused_naming_the_slices_and_the_flag():
    with pytest.raises(DraRefusal, match="no ResourceSlice of driver gpu.qgpu.io publishes a card yet.*--dra-card-memory-mib"):
        convert(percent_pod(), DraConfig(published=lambda: ()))


def test_unreadable_slices_are_a_500_and_other_pods_never_ask_for_them():
    def broken() -> tuple[int, ...]:
        raise CardSizesUnavailable("listing ResourceSlices of driver gpu.qgpu.io: the apiserver answered 403 Forbidden")

    config = DraConfig(published=broken)
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u", "operation": "CREATE", "namespace": "ns", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "object": percent_pod()}}
    answer = mutate_dra(json.dumps(review), WebhookConfig(), config, lambda ns, templates: None)["response"]
    assert answer["allowed"] is False and answer["status"]["code"] == 500
    assert "card sizes of the DRA pools cannot be read" in answer["status"]["message"] and "403 Forbidden" in answer["status"]["message"]
    share = percent_pod()
    share["spec"]["containers"][0]["resources"]["limits"] = {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"}
    assert convert(share, config).templates  # no percent: the slices are never read


def test_the_slices_are_read_a_page_at_a_time_each_under_the_byte_cap():
    """A compromised node writes many slices, each near etcd's object limit (labels): the webhook
    reads them in pages under kube/paging.py's cap, a page past it asked again with fewer items,
    and keeps only each page's sizes. 250 slices: every node's size counted."""
    from kubernetes import client

    from qgpu_runtime.kube.paging import LIST_PAGE_BYTES
    from qgpu_runtime.webhook.cardsizes import SliceCardSizes
    from tests.webhook.test_claim_quota_serving import Response, page

    slices = [slice_of(f"n{i}", 15360) for i in range(240)] + [slice_of(f"m{i}", 32768) for i in range(10)]
    for s in slices[:8]:
        s["metadata"] = {"labels": {f"l{j}": "x" * 60 for j in range(9000)}}  # ~0.6 MiB each
    answered: list[Response] = []

    class Api:
        def list_resource_slice(self, **kwargs: Any) -> Response:
            assert kwargs["field_selector"] == f"spec.driver={dra.DRIVER}"
            answered.append(page(slices, **{k: v for k, v in kwargs.items() if k in ("limit", "_continue")}))
            return answered[-1]

    sizes = SliceCardSizes(client.ApiClient())
    sizes.api = Api()  # type: ignore[assignment]
    assert sizes() == (15360, 32768)
    assert len(answered) > 3 and all(r.closed for r in answered if len(r.data) > LIST_PAGE_BYTES)
    assert any(len(r.data) > LIST_PAGE_BYTES for r in answered)  # the first page was past the cap


def test_no_published_size_is_listed_again_after_a_second_not_at_every_check():
    """Every quota check asks the card sizes; while no slice publishes one, the empty answer was
    not kept, so each pod a tenant created cost the apiserver a LIST of every ResourceSlice. Now
    an empty answer is kept ``empty_refresh_s`` (1 s) and a published one ``refresh_s`` (10 s)."""
    from kubernetes import client

    from qgpu_runtime.webhook.cardsizes import SliceCardSizes
    from tests.webhook.test_claim_quota_serving import page

    published: list[dict] = []
    lists: list[int] = []
    now = [100.0]

    class Api:
        def list_resource_slice(self, **kwargs: Any):
            lists.append(1)
            return page(published, **{k: v for k, v in kwargs.items() if k in ("limit", "_continue")})

    sizes = SliceCardSizes(client.ApiClient(), monotonic=lambda: now[0])
    sizes.api = Api()  # type: ignore[assignment]
    for _ in range(50):
        assert sizes() == ()
    assert len(lists) == 1
    published.append(slice_of("n1", 15360))
    now[0] += 0.5
    assert sizes() == () and len(lists) == 1  # still the empty answer, half a second old
    now[0] += 0.6
    assert sizes() == (15360,) and len(lists) == 2  # the pool's first size, a second later
    now[0] += 9.0
    for _ in range(50):
        assert sizes() == (15360,)
    assert len(lists) == 2
    now[0] += 1.1
    assert sizes() == (15360,) and len(lists) == 3
