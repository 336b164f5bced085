"""The Lease rights the templates render (issue 21 §3): qgpu's own namespace by default, writes held
to qgpu's prefixes by admission policies, the prefixes those of contract/names.py. The same objects
against a real apiserver with real tokens: tests/k8s/test_e2e_lease_privilege.py."""

from __future__ import annotations

from pathlib import Path

import yaml

from qgpu_runtime.contract.names import BINDERS_LEASE, CLAIM_QUOTA_LEASE_PREFIX, COMMITMENTS_LEASE_PREFIX
from tests.k8s.rbac import render_template

ROOT = Path(__file__).resolve().parents[2]
WEBHOOK = {"qgpu_webhook_dra": True, "qgpu_webhook_image": "qgpu:test", "qgpu_webhook_ca_bundle": "",
           "qgpu_webhook_tls_crt": "", "qgpu_webhook_tls_key": "", "qgpu_webhook_client_ca": ""}


def by_name(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_every_role_defaults_to_qgpus_own_namespace():
    for role in ("qgpu_scheduler", "qgpu_webhook", "qgpu_manager"):
        defaults = yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text())
        assert defaults[f"{role}_namespace"] == "{{ qgpu_namespace | default('qgpu-system') }}", role
        assert defaults[f"{role}_retire_namespace"] == "{{ qgpu_retire_namespace | default('kube-system') }}", role
    for inventory in ("example", "local-cluster"):
        group_vars = yaml.safe_load((ROOT / "inventories" / inventory / "group_vars" / "all.yml").read_text())
        assert group_vars["qgpu_namespace"] == "qgpu-system", inventory


def test_the_extenders_lease_writes_are_held_to_its_commitments_in_its_namespace():
    docs = render_template("qgpu-scheduler.yaml.j2")
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "qgpu-system"
    policy = by_name(docs, "ValidatingAdmissionPolicy")["qgpu-scheduler-own-leases"]
    rule = policy["spec"]["matchConstraints"]["resourceRules"][0]
    assert (rule["resources"], sorted(rule["operations"])) == (["leases"], ["CREATE", "DELETE", "UPDATE"])
    assert policy["spec"]["matchConditions"][0]["expression"] == \
        "request.userInfo.username == 'system:serviceaccount:qgpu-system:qgpu-scheduler'"
    assert policy["spec"]["validations"][0]["expression"] == \
        f"request.namespace == 'qgpu-system' && (request.name.startsWith('{COMMITMENTS_LEASE_PREFIX}') || request.name == '{BINDERS_LEASE}')"
    assert by_name(docs, "ValidatingAdmissionPolicyBinding")["qgpu-scheduler-own-leases"]["spec"]["validationActions"] == ["Deny"]
    vars_ = yaml.safe_load((ROOT / "roles/qgpu_scheduler/vars/main.yml").read_text())
    assert vars_["__qgpu_scheduler_lease_prefix"] == COMMITMENTS_LEASE_PREFIX


def test_in_kube_system_the_policies_still_name_only_qgpus_leases():
    scheduler = render_template("qgpu-scheduler.yaml.j2", qgpu_scheduler_namespace="kube-system")
    webhook = render_template("qgpu-webhook.yaml.j2", qgpu_webhook_namespace="kube-system", **WEBHOOK)
    own = by_name(scheduler, "ValidatingAdmissionPolicy")["qgpu-scheduler-own-leases"]["spec"]["validations"][0]
    assert own["expression"] == (f"request.namespace == 'kube-system' && (request.name.startsWith('{COMMITMENTS_LEASE_PREFIX}') "
                                 f"|| request.name == '{BINDERS_LEASE}')")
    names = by_name(webhook, "ValidatingAdmissionPolicy")["qgpu-webhook-own-names"]["spec"]["validations"]
    assert any(f"request.name.startsWith('{CLAIM_QUOTA_LEASE_PREFIX}')" in v["expression"]
               and "request.namespace == 'kube-system'" in v["expression"] for v in names)


def test_without_commitments_the_extender_gets_no_lease_rights_and_no_lease_policy():
    docs = render_template("qgpu-scheduler.yaml.j2", qgpu_scheduler_node_commitments=False)
    assert not [d for d in docs if d["kind"] == "Role"]
    assert "qgpu-scheduler-own-leases" not in by_name(docs, "ValidatingAdmissionPolicy")


def test_the_per_namespace_hold_share_is_passed_only_when_set():
    def args(**variables: object) -> list[str]:
        (ds,) = [d for d in render_template("qgpu-scheduler.yaml.j2", **variables) if d["kind"] == "DaemonSet"]
        return ds["spec"]["template"]["spec"]["containers"][0]["args"]

    assert not [a for a in args() if a.startswith("--max-holds-per-namespace")]
    assert "--max-holds-per-namespace=7" in args(qgpu_scheduler_max_holds_per_namespace=7)


def test_the_bound_gpu_pod_policy_exempts_nodes_and_only_the_creators_the_operator_names():
    """qgpu-pod-placed-by-extender applies to every requester but a node (its mirror pods) and the
    usernames of qgpu_scheduler_bound_gpu_pod_creators (software placing its own GPU pods on nodes
    qgpu does not serve): none by default."""
    default = by_name(render_template("qgpu-scheduler.yaml.j2"), "ValidatingAdmissionPolicy")["qgpu-pod-placed-by-extender"]
    conditions = {c["name"]: c["expression"] for c in default["spec"]["matchConditions"]}
    assert conditions["not-a-node"] == "!('system:nodes' in request.userInfo.groups)"
    assert conditions["not-an-exempt-creator"] == "!(request.userInfo.username in [])"
    creator = "system:serviceaccount:gpu-operator:nvidia-operator-validator"
    named = by_name(render_template("qgpu-scheduler.yaml.j2", qgpu_scheduler_bound_gpu_pod_creators=[creator]),
                    "ValidatingAdmissionPolicy")["qgpu-pod-placed-by-extender"]
    assert {c["name"]: c["expression"] for c in named["spec"]["matchConditions"]}["not-an-exempt-creator"] == \
        f'!(request.userInfo.username in ["{creator}"])'
