"""The webhook manifest the qgpu_webhook role renders for each pool mode (issue 13 §4, §5): with a
dra pool in the inventory the webhook runs --dra with exactly the RBAC it calls, /mutate-dra for
qgpu.io/gpu-mode=dra namespaces (which /mutate then skips), the claim-quota entry and the policy
holding its account to qgpu's names; with device-plugin pools only, nothing of that."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_tools import ansible_playbook

from qgpu_runtime.contract.dra import QGPU_CLASSES
from qgpu_runtime.contract.names import CLAIM_QUOTA_LEASE_PREFIX
from qgpu_runtime.webhook.dra import CLAIM_PREFIX


def render(tmp_path: Path, pool_mode: str, **role_vars: Any) -> list[dict[str, Any]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {
        "hosts": {"localhost": {"ansible_connection": "local"}},
        "children": {"qgpu_gpu_nodes": {"hosts": {"gpu-1": {"qgpu_pool_mode": pool_mode}, "gpu-2": {}}}}}}))
    playbook = tmp_path / "render.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Render the webhook", "hosts": "localhost", "gather_facts": False,
        "vars": {"ansible_python_interpreter": "{{ ansible_playbook_python }}", "qgpu_root_prefix": str(tmp_path / "root")},
        "tasks": [{"name": "Render without applying", "ansible.builtin.include_role": {"name": "qgpu_webhook"},
                   "vars": {"qgpu_webhook_apply": False, **role_vars}}]}]))
    run = ansible_playbook("-i", str(inventory), str(playbook))
    assert run.returncode == 0, run.output[-4000:]
    manifest = tmp_path / "root/etc/qgpu/manifests/qgpu-webhook.yaml"
    return [d for d in yaml.safe_load_all(manifest.read_text()) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str = "qgpu-webhook") -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def hooks(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {h["name"]: h for h in one(docs, kind)["webhooks"]}


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture(scope="module")
def dra_docs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render(tmp_path_factory.mktemp("dra"), "dra", qgpu_webhook_dra_card_memory_mib=[15360, 32768])


@pytest.fixture(scope="module")
def device_plugin_docs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render(tmp_path_factory.mktemp("dp"), "device-plugin")


def test_device_plugin_pools_get_the_one_gpu_quota_with_exactly_the_rbac_it_calls(device_plugin_docs):
    """Issue 22 §5: /validate charges every dialect against gpu.qgpu.io/core|memory (--pod-quota),
    with reads of the namespace's quotas, claims and pods and the ledger, and nothing of DRA."""
    docs = device_plugin_docs
    assert one(docs, "ServiceAccount")["automountServiceAccountToken"] is True
    assert container(docs)["args"][-4:] == ["--pod-quota", "--quota-ledger-namespace=qgpu-system", "--claim-reservation-seconds=30",
                                            "--largest-card-memory-mib=81920"]
    assert not [a for a in container(docs)["args"] if a.startswith("--dra")]
    assert one(docs, "ClusterRole", "qgpu-webhook-quota")["rules"] == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["resourcequotas", "pods"], "verbs": ["list"]}]
    assert not [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "qgpu-webhook-dra"]
    role = one(docs, "Role", "qgpu-webhook-claim-quota-ledger")
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}]
    assert one(docs, "ValidatingAdmissionPolicy", "qgpu-webhook-own-names")
    entry = hooks(docs, "ValidatingWebhookConfiguration")["validate.qgpu.io"]
    assert entry["sideEffects"] == "NoneOnDryRun" and entry["timeoutSeconds"] == 10 and entry["failurePolicy"] == "Fail"
    assert set(hooks(docs, "MutatingWebhookConfiguration")) == {"mutate.qgpu.io"}


def test_a_drain_leaves_a_webhook_replica_serving(device_plugin_docs):
    """failurePolicy Fail: with both replicas gone no GPU pod is admitted. A PodDisruptionBudget lets
    a drain take one at a time, and the replicas prefer different nodes."""
    budget = one(device_plugin_docs, "PodDisruptionBudget", "qgpu-webhook")
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "qgpu-webhook"}}}
    pod = one(device_plugin_docs, "Deployment")["spec"]["template"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_the_largest_card_the_quota_charges_is_the_operators(tmp_path: Path):
    """An H200 pool: a whole card is charged 143771 MiB, not the 80 GiB default."""
    docs = render(tmp_path, "device-plugin", qgpu_webhook_largest_card_memory_mib=143771)
    assert "--largest-card-memory-mib=143771" in container(docs)["args"]


def test_device_plugin_pools_without_the_pod_quota_keep_the_webhook_without_api_access(tmp_path: Path):
    docs = render(tmp_path, "device-plugin", qgpu_webhook_pod_quota=False)
    assert one(docs, "ServiceAccount")["automountServiceAccountToken"] is False
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "Role", "ValidatingAdmissionPolicy")]
    assert not [a for a in container(docs)["args"] if "dra" in a or "claim" in a or "ledger" in a]
    assert set(hooks(docs, "MutatingWebhookConfiguration")) == {"mutate.qgpu.io"}
    assert set(hooks(docs, "ValidatingWebhookConfiguration")) == {"validate.qgpu.io"}
    selector = hooks(docs, "MutatingWebhookConfiguration")["mutate.qgpu.io"]["namespaceSelector"]["matchExpressions"]
    assert not [e for e in selector if e["key"] == "qgpu.io/gpu-mode"]


def test_a_dra_pool_runs_the_webhook_with_dra_and_its_flags(dra_docs):
    args = container(dra_docs)["args"]
    assert args[-7:] == ["--dra", "--dra-card-memory-mib=15360", "--dra-card-memory-mib=32768", "--pod-quota",
                         "--quota-ledger-namespace=qgpu-system", "--claim-reservation-seconds=30", "--largest-card-memory-mib=81920"]
    assert one(dra_docs, "ServiceAccount")["automountServiceAccountToken"] is True
    assert one(dra_docs, "Deployment")["spec"]["template"]["spec"]["automountServiceAccountToken"] is True


def test_the_dra_rbac_is_exactly_what_the_webhook_calls(dra_docs):
    assert one(dra_docs, "ClusterRole", "qgpu-webhook-dra")["rules"] == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaimtemplates"], "verbs": ["get", "create"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list"]}]
    assert one(dra_docs, "ClusterRole", "qgpu-webhook-quota")["rules"] == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["resourcequotas", "pods"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]}]
    role = one(dra_docs, "Role", "qgpu-webhook-claim-quota-ledger")
    assert role["metadata"]["namespace"] == "qgpu-system"
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}]
    for kind, name in (("ClusterRoleBinding", "qgpu-webhook-dra"), ("ClusterRoleBinding", "qgpu-webhook-quota"),
                       ("RoleBinding", "qgpu-webhook-claim-quota-ledger")):
        assert one(dra_docs, kind, name)["subjects"] == [{"kind": "ServiceAccount", "name": "qgpu-webhook", "namespace": "qgpu-system"}]


def test_dra_namespaces_get_mutate_dra_and_mutate_skips_them(dra_docs):
    mutating = hooks(dra_docs, "MutatingWebhookConfiguration")
    assert set(mutating) == {"mutate.qgpu.io", "mutate-dra.qgpu.io"}
    dra_hook = mutating["mutate-dra.qgpu.io"]
    assert dra_hook["sideEffects"] == "NoneOnDryRun" and dra_hook["timeoutSeconds"] == 10
    assert dra_hook["clientConfig"]["service"]["path"] == "/mutate-dra"
    gpu_mode = {"key": "qgpu.io/gpu-mode", "values": ["dra"]}
    assert {**gpu_mode, "operator": "In"} in dra_hook["namespaceSelector"]["matchExpressions"]
    assert {**gpu_mode, "operator": "NotIn"} in mutating["mutate.qgpu.io"]["namespaceSelector"]["matchExpressions"]
    assert dra_hook["matchConditions"] == mutating["mutate.qgpu.io"]["matchConditions"]


def test_the_claim_quota_entry_fails_closed_on_claim_creates_of_qgpu_classes(dra_docs):
    validating = hooks(dra_docs, "ValidatingWebhookConfiguration")
    assert set(validating) == {"validate.qgpu.io", "claim-quota.qgpu.io"}
    entry = validating["claim-quota.qgpu.io"]
    assert entry["failurePolicy"] == "Fail" and entry["sideEffects"] == "NoneOnDryRun" and entry["timeoutSeconds"] == 10
    assert entry["clientConfig"]["service"]["path"] == "/validate-claim"
    assert entry["rules"] == [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE"],
                               "resources": ["resourceclaims"], "scope": "Namespaced"}]
    assert entry["matchPolicy"] == "Equivalent"
    (condition,) = entry["matchConditions"]
    assert json.dumps(sorted(QGPU_CLASSES)) in condition["expression"]


def test_the_admission_policy_holds_the_webhook_to_qgpus_names(dra_docs):
    policy = one(dra_docs, "ValidatingAdmissionPolicy", "qgpu-webhook-own-names")
    assert policy["spec"]["matchConditions"] == [
        {"name": "is-the-webhook", "expression": "request.userInfo.username == 'system:serviceaccount:qgpu-system:qgpu-webhook'"}]
    expressions = " ".join(v["expression"] for v in policy["spec"]["validations"])
    assert f"request.name.startsWith('{CLAIM_PREFIX}')" in expressions
    assert f"request.name.startsWith('{CLAIM_QUOTA_LEASE_PREFIX}')" in expressions
    assert one(dra_docs, "ValidatingAdmissionPolicyBinding", "qgpu-webhook-own-names")["spec"]["validationActions"] == ["Deny"]


def test_dra_can_be_decided_explicitly_and_bad_settings_are_refused(tmp_path: Path):
    docs = render(tmp_path / "off", "dra", qgpu_webhook_dra=False)
    assert set(hooks(docs, "MutatingWebhookConfiguration")) == {"mutate.qgpu.io"}
    with pytest.raises(AssertionError, match="qgpu_webhook_dra_timeout_seconds=5 must be within 10..30"):
        render(tmp_path / "bad", "dra", qgpu_webhook_dra_timeout_seconds=5)


def test_the_dra_webhook_reaches_the_apiserver_where_the_node_does(tmp_path: Path) -> None:
    # Clusters whose pods cannot reach the kubernetes Service (the local cluster: no kube-proxy):
    # --dra calls the apiserver, so it gets the address the other components use.
    docs = render(tmp_path / "dra", "dra", qgpu_kube_apiserver_host="127.0.0.1", qgpu_kube_apiserver_port=6443)
    assert {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"} in container(docs)["env"]
    assert {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"} in container(docs)["env"]


def test_the_device_plugin_webhook_reaches_the_apiserver_for_the_pod_quota_and_needs_no_address_without_it(tmp_path: Path) -> None:
    docs = render(tmp_path / "dp", "device-plugin", qgpu_kube_apiserver_host="127.0.0.1")
    assert {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"} in container(docs)["env"]
    docs = render(tmp_path / "dp-no-quota", "device-plugin", qgpu_kube_apiserver_host="127.0.0.1", qgpu_webhook_pod_quota=False)
    assert "env" not in container(docs)


def _secret(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Secret", "qgpu-webhook-tls")


def test_the_webhook_answers_only_the_apiservers_client_certificate(dra_docs, device_plugin_docs):
    """Both pool modes: --client-ca-file names the client CA carried in the TLS Secret (issue 21 §2)."""
    for docs in (dra_docs, device_plugin_docs):
        args = container(docs)["args"]
        assert "--client-ca-file=/etc/qgpu/tls/client-ca.crt" in args and "--insecure-no-client-auth" not in args
        ca = base64.b64decode(_secret(docs)["data"]["client-ca.crt"]).decode()
        assert ca.startswith("-----BEGIN CERTIFICATE-----")
        assert ca != base64.b64decode(_secret(docs)["data"]["tls.crt"]).decode()


def test_the_opt_out_serves_validate_and_mutate_without_client_certificates(tmp_path):
    docs = render(tmp_path / "optout", "device-plugin", qgpu_webhook_client_auth=False, qgpu_webhook_pod_quota=False)
    args = container(docs)["args"]
    assert "--insecure-no-client-auth" in args and not [a for a in args if a.startswith("--client-ca-file")]
    assert "client-ca.crt" not in _secret(docs)["data"]
    # the pod quota writes its ledger on /validate: only the apiserver's certificate may call it
    with pytest.raises(AssertionError, match="the pod quota reserves in the ledger"):
        render(tmp_path / "optout-quota", "device-plugin", qgpu_webhook_client_auth=False)


def test_the_opt_out_is_refused_with_dra_pools(tmp_path):
    (tmp_path / "refused").mkdir()
    inventory = tmp_path / "refused/hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {
        "hosts": {"localhost": {"ansible_connection": "local"}},
        "children": {"qgpu_gpu_nodes": {"hosts": {"gpu-1": {"qgpu_pool_mode": "dra"}}}}}}))
    playbook = tmp_path / "refused/render.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Render the webhook", "hosts": "localhost", "gather_facts": False,
        "vars": {"ansible_python_interpreter": "{{ ansible_playbook_python }}", "qgpu_root_prefix": str(tmp_path / "root")},
        "tasks": [{"name": "Render", "ansible.builtin.include_role": {"name": "qgpu_webhook"},
                   "vars": {"qgpu_webhook_apply": False, "qgpu_webhook_client_auth": False}}]}]))
    run = ansible_playbook("-i", str(inventory), str(playbook))
    assert run.returncode != 0
    assert "qgpu_webhook_client_auth=false with DRA pools" in run.output
