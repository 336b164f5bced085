"""The webhook configurations of templates/kubernetes/qgpu-webhook.yaml.j2 in the real kube-apiserver:
their matchConditions send only GPU pods to the webhook, so while it is unreachable a plain pod is
still created and a GPU pod is refused (fail closed); while it is up a GPU pod is admitted, mutated."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from typing import Any, Iterator

import jinja2
import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.model.requests import GPU_RESOURCES
from tests.k8s.controlplane import QgpuServer, free_port
from tests.k8s.kubeobjects import PAUSE, REPO, gpu_pod, read_pod

CONFIG_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
GPU_PODS = {  # one per place a GPU resource may be asked for
    "container-limits": {"containers": [{"name": "c", "image": PAUSE,
                                         "resources": {"limits": {"tensorstack.dev/nvidia-gpu": "1"}}}]},
    "init-requests": {"initContainers": [{"name": "i", "image": PAUSE,
                                          "resources": {"requests": {"nvidia.com/gpu": "1"}}}],
                      "containers": [{"name": "c", "image": PAUSE}]},
}


def rendered_configurations(ca_bundle: str) -> list[dict[str, Any]]:
    """Both webhook configurations as the qgpu_webhook role renders them from its defaults."""
    defaults = yaml.safe_load((REPO / "roles/qgpu_webhook/defaults/main.yml").read_text())
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(REPO / "templates" / "kubernetes")),
                             undefined=jinja2.StrictUndefined)
    env.filters["to_json"] = json.dumps
    env.filters["combine"] = lambda a, b: {**a, **b}
    env.filters["hash"] = lambda text, algorithm: hashlib.new(algorithm, str(text).encode()).hexdigest()
    env.filters["bool"] = lambda value: value is True or str(value).strip().lower() in ("yes", "on", "1", "true", "y", "t")
    role_vars = yaml.safe_load((REPO / "roles/qgpu_webhook/vars/main.yml").read_text())
    variables = {**defaults, **role_vars, "qgpu_webhook_dra": False, "qgpu_webhook_namespace": "qgpu-system", "qgpu_webhook_image": "qgpu:test",
                 "qgpu_webhook_ca_bundle": ca_bundle, "qgpu_webhook_tls_crt": "", "qgpu_webhook_tls_key": "",
                 "qgpu_webhook_client_ca": ""}
    text = env.get_template("qgpu-webhook.yaml.j2").render(ansible_managed="test", **variables)
    return [d for d in yaml.safe_load_all(text) if d and d["kind"] in CONFIG_KINDS]


def register(cluster, url: str, label: dict[str, str]) -> list[tuple[str, str]]:
    """Create the rendered configurations, pointed at ``url`` and narrowed to namespaces carrying
    ``label`` (other tests share this apiserver); everything else is the template's."""
    ca_bundle = base64.b64encode(cluster.cp.ca.pem).decode()
    api = client.AdmissionregistrationV1Api(cluster.api_client)
    created = []
    for config in rendered_configurations(ca_bundle):
        name = f"qgpu-match-{label['qgpu-match']}-{config['kind'][:8].lower()}"
        config["metadata"]["name"] = name
        for hook in config["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": url + path, "caBundle": ca_bundle}
            hook["namespaceSelector"] = {**hook["namespaceSelector"], "matchLabels": label}
        if config["kind"] == "MutatingWebhookConfiguration":
            api.create_mutating_webhook_configuration(config)
        else:
            api.create_validating_webhook_configuration(config)
        created.append((config["kind"], name))
    return created


def unregister(cluster, created: list[tuple[str, str]]) -> None:
    api = client.AdmissionregistrationV1Api(cluster.api_client)
    for kind, name in created:
        delete = api.delete_mutating_webhook_configuration if kind == CONFIG_KINDS[0] else api.delete_validating_webhook_configuration
        delete(name)


def labelled_namespace(cluster, label: dict[str, str]) -> str:
    ns = cluster.namespace()
    cluster.api.patch_namespace(ns, {"metadata": {"labels": label}})
    return ns


def pod(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": json.loads(json.dumps(spec))}


def refusal(cluster, namespace: str, body: dict[str, Any]) -> str | None:
    """The apiserver's message when it refuses to create ``body``; None when it creates it."""
    try:
        cluster.api.create_namespaced_pod(namespace, body)
    except ApiException as exc:
        return str(json.loads(exc.body)["message"])
    return None


@pytest.fixture(scope="module")
def webhook_down(cluster) -> Iterator[str]:
    """The configurations pointed at a port nothing listens on."""
    label = {"qgpu-match": "down"}
    created = register(cluster, f"https://127.0.0.1:{free_port()}", label)
    try:
        yield labelled_namespace(cluster, label)
    finally:
        unregister(cluster, created)


@pytest.fixture(scope="module")
def webhook_up(cluster) -> Iterator[str]:
    cp = cluster.cp
    pair = cp.ca.issue("webhook-match", "qgpu-webhook", server=True, hosts=("127.0.0.1",))
    port = free_port()
    server = QgpuServer("qgpu-webhook-match", ["webhook", "serve", "--address", "127.0.0.1", "--port", str(port),
                                               "--tls-cert-file", str(pair.cert), "--tls-private-key-file", str(pair.key),
                                               "--scheduler-name", "qgpu-scheduler", *cp.webhook_auth_args()],
                        cp.workdir, port, "https", cp.ca.cert_path, client_cert=cp.webhook_client)
    server.start(ready_path="/healthz")
    label = {"qgpu-match": "up"}
    created = register(cluster, server.url, label)
    try:
        yield labelled_namespace(cluster, label)
    finally:
        unregister(cluster, created)
        server.stop()


def refused_once_active(cluster, namespace: str, name: str, spec: dict[str, Any]) -> str:
    """The refusal of a GPU pod, waiting out the apiserver picking the configurations up (a watch):
    a pod created before that is deleted and tried again under a new name."""
    deadline = time.monotonic() + 30
    n = 0
    while (message := refusal(cluster, namespace, pod(f"{name}-{n}", spec))) is None:
        cluster.api.delete_namespaced_pod(f"{name}-{n}", namespace, grace_period_seconds=0)
        assert time.monotonic() < deadline, "the webhook configurations never became active"
        n += 1
        time.sleep(0.5)
    return message


def test_the_conditions_name_every_resource_qgpu_parses():
    """A dialect missing from the role's list would skip validation and mutation altogether."""
    defaults = yaml.safe_load((REPO / "roles/qgpu_webhook/defaults/main.yml").read_text())
    assert sorted(defaults["qgpu_webhook_gpu_resources"]) == sorted(GPU_RESOURCES)


@pytest.mark.parametrize("where", sorted(GPU_PODS))
def test_a_gpu_pod_is_refused_while_the_webhook_is_unreachable(cluster, webhook_down, where):
    message = refused_once_active(cluster, webhook_down, f"gpu-{where}", GPU_PODS[where])
    assert "qgpu.io" in message and "failed calling webhook" in message, message


def test_a_plain_pod_is_created_while_the_webhook_is_unreachable(cluster, webhook_down):
    refused_once_active(cluster, webhook_down, "probe", GPU_PODS["container-limits"])  # the configurations are live
    plain = {"containers": [{"name": "c", "image": PAUSE, "resources": {"limits": {"cpu": "100m"}}}]}
    assert refusal(cluster, webhook_down, pod("plain", plain)) is None


def test_a_gpu_pod_is_admitted_and_mutated_while_the_webhook_is_up(cluster, webhook_up):
    deadline = time.monotonic() + 30
    n = 0
    while True:  # the configurations become active through a watch
        name = f"whole-{n}"
        cluster.api.create_namespaced_pod(webhook_up, gpu_pod(name, {"tensorstack.dev/nvidia-gpu": 1}))
        created = read_pod(cluster.api, webhook_up, name)
        if created["spec"]["schedulerName"] == "qgpu-scheduler":
            break
        assert time.monotonic() < deadline, "the mutating webhook never became active"
        n += 1
        time.sleep(0.5)
    assert created["spec"]["containers"][0]["resources"]["requests"]["tensorstack.dev/nvidia-gpu"] == "1"
