"""Issue 22 §1 and §3 at the webhook: zero requests admitted untouched; HAMi's errors denied;
KAI's annotations turned into the container's nvidia.com/gpu; both converted on DRA pools."""

from __future__ import annotations

from qgpu_runtime.webhook.admission import WebhookConfig, mutate, validate
from qgpu_runtime.webhook.dra import DraConfig
from tests.webhook.test_webhook_admission import patch_of, review
from tests.webhook.test_webhook_dra import applied, apply_patch, container, only_request, pod

CONFIG = WebhookConfig(scheduler_name="qgpu-scheduler")


def test_zero_requests_are_admitted_and_left_alone():
    for limits in ({"nvidia.com/gpu": "0"}, {"tencent.com/vcuda-core": "0"}, {"tensorstack.dev/nvidia-gpu": "0"},
                   {"tke.cloud.tencent.com/qgpu-core": "0"}):
        p = pod(container(limits=limits))
        assert validate(review(p), CONFIG)["response"]["allowed"] is True, limits
        ops = patch_of(mutate(review(p), CONFIG))
        assert all(op["path"] != "/spec/schedulerName" for op in ops), ops  # a CPU pod keeps its scheduler


def test_hamis_bad_combination_is_denied_with_the_rule():
    p = pod(container(limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000", "nvidia.com/gpumem-percentage": "50"}))
    answer = validate(review(p), CONFIG)["response"]
    assert answer["allowed"] is False
    assert "give one of nvidia.com/gpumem (MiB) or nvidia.com/gpumem-percentage (%), not both" in answer["status"]["message"]


def test_hami_resources_are_copied_between_requests_and_limits():
    p = pod(container(limits={"nvidia.com/gpu": "2", "nvidia.com/gpumem": "3000"}))
    after = apply_patch(p, patch_of(mutate(review(p), CONFIG)))
    assert after["spec"]["containers"][0]["resources"]["requests"] == {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "3000"}


def test_a_hami_share_without_nvidia_gpu_gets_its_one_card_as_hamis_webhook_writes_it():
    """`nvidia.com/gpumem: 3000` alone is one card (HAMi's defaultGPUNum). Without nvidia.com/gpu the
    kubelet never calls the device plugin (it serves nvidia.com/gpu, not gpumem): the extender
    booked a share the container never got."""
    for limits, requests in (({"nvidia.com/gpumem": "3000"}, None), (None, {"nvidia.com/gpumem": "3000"}),
                             ({"nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}, {"nvidia.com/gpumem": "3000"})):
        p = pod(container(limits=limits, requests=requests))
        after = apply_patch(p, patch_of(mutate(review(p), CONFIG)))
        resources = after["spec"]["containers"][0]["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "1", resources
        assert resources["limits"] == resources["requests"], resources
        assert validate(review(after), CONFIG)["response"]["allowed"] is True
        assert apply_patch(after, patch_of(mutate(review(after), CONFIG))) == after  # once
    # a HAMi pod that names its cards keeps them; the chart's zero-GPU variant stays CPU-only
    for limits in ({"nvidia.com/gpu": "2", "nvidia.com/gpumem": "3000"}, {"nvidia.com/gpu": "0", "nvidia.com/gpumem": "3000"}):
        p = pod(container(limits=dict(limits)))
        after = apply_patch(p, patch_of(mutate(review(p), CONFIG)))
        assert after["spec"]["containers"][0]["resources"]["limits"] == limits


def test_kai_annotations_become_the_named_containers_nvidia_gpu():
    p = pod(container("main"), container("side"), schedulerName="kai-scheduler",
            annotations={"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2", "gpu-fraction-container-name": "side"})
    after = apply_patch(p, patch_of(mutate(review(p), CONFIG)))
    main, side = after["spec"]["containers"]
    assert main["resources"] == {}
    assert side["resources"] == {"limits": {"nvidia.com/gpu": "2"}, "requests": {"nvidia.com/gpu": "2"}}
    assert after["spec"]["schedulerName"] == "kai-scheduler"  # H's profile of that name serves it
    assert validate(review(after), CONFIG)["response"]["allowed"] is True
    # mutating the mutated pod again changes nothing more
    assert apply_patch(after, patch_of(mutate(review(after), CONFIG))) == after


def test_kai_container_without_a_resources_section_gets_one():
    p = pod({"name": "c", "image": "busybox"}, schedulerName="kai-scheduler", annotations={"gpu-memory": "2000"})
    after = apply_patch(p, patch_of(mutate(review(p), CONFIG)))
    assert after["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}}


# -- DRA pools -------------------------------------------------------------------------------------

def test_dra_leaves_a_zero_request_alone_and_converts_the_other_container():
    p = pod(container("cpu", limits={"nvidia.com/gpu": "0"}),
            container("gpu", limits={"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "2"}))
    after, templates = applied(p)
    assert after["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "0"}}
    assert after["spec"]["containers"][1]["resources"]["claims"] == [{"name": "qgpu-1"}]
    assert len(templates) == 1


def test_dra_hami_vgpus_are_one_share_on_each_of_n_distinct_cards():
    p = pod(container(limits={"nvidia.com/gpu": "2", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}),
            annotations={"nvidia.com/use-gputype": "A100"})
    after, templates = applied(p)
    assert "nvidia.com/gpu" not in (after["spec"]["containers"][0]["resources"].get("limits") or {})
    ((name, spec),) = templates.items()
    exactly = only_request(spec)["exactly"]
    assert (exactly["count"], exactly["capacity"]["requests"]) == (2, {"core": "300", "memory": "3072"})
    assert spec["devices"]["constraints"] == [{"requests": ["gpu"], "distinctAttribute": "gpu.qgpu.io/uuid"}]
    assert exactly["selectors"] == [{"cel": {"expression": '(device.attributes["gpu.qgpu.io"].model.upperAscii().contains("A100"))'}}]


def test_dra_kai_fraction_uses_the_pools_card_sizes():
    p = pod(container("main"), schedulerName="kai-scheduler", annotations={"gpu-fraction": "0.5"})
    after, templates = applied(p, DraConfig(card_memory_mib=(16384,)))
    assert after["spec"]["containers"][0]["resources"] == {"claims": [{"name": "qgpu-0"}]}
    ((name, spec),) = templates.items()
    (sub,) = only_request(spec)["firstAvailable"]
    assert sub["capacity"]["requests"]["memory"] == "8192"


def test_dra_kai_share_is_charged_once_as_its_claim_not_again_as_the_pod():
    """The pod /mutate-dra leaves (KAI's annotations, the claim, no nvidia.com/gpu) is charged
    nothing as a pod; the claim its template makes is charged the share."""
    from qgpu_runtime.webhook.claimquota import Usage, claim_usage
    from qgpu_runtime.webhook.podquota import pod_usage

    p = pod(container("main", limits={"nvidia.com/gpu": "2"}), schedulerName="kai-scheduler",
            annotations={"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"})
    after, templates = applied(p, DraConfig(card_memory_mib=(16384,)))
    assert after["spec"]["containers"][0]["resources"] == {"limits": {}, "claims": [{"name": "qgpu-0"}]}
    assert pod_usage(after, dra_namespace=True) == Usage()
    ((name, spec),) = templates.items()
    claim = {"metadata": {"namespace": "team-a", "name": f"kai-{name}"}, "spec": spec}
    assert claim_usage(claim).memory_mib == 2 * 8192  # half of each of two 16 GiB cards
