"""What a node's identities may write on the pods bound to it, as the manager's template renders it:
its manager's token only the annotation the manager writes (qgpu.io/assigned), its kubelet no
qgpu.io/ annotation at all. A pod's qgpu.io/group-min-member is its owner's: raised on one member of
a T9k group by a compromised node, it held the group's members on every other node until the group
timeout. The same objects against a real apiserver with real tokens: tests/k8s/test_e2e_least_privilege.py."""

from __future__ import annotations

from pathlib import Path

import yaml

from qgpu_runtime.contract import names
from tests.k8s.rbac import render_template

ROOT = Path(__file__).resolve().parents[2]


def policies(**variables: object) -> dict[str, dict]:
    docs = render_template("qgpu-manager.yaml.j2", qgpu_manager_profiles=[], **variables)
    bindings = {d["spec"]["policyName"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    found = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    assert set(bindings) == set(found) and all(b["spec"]["validationActions"] == ["Deny"] for b in bindings.values())
    return found


def test_the_managers_token_changes_on_a_pod_only_the_annotation_the_manager_writes():
    role = yaml.safe_load((ROOT / "roles/qgpu_manager/vars/main.yml").read_text())
    assert role["__qgpu_manager_pod_annotations"] == [names.ASSIGNED]
    spec = policies()["qgpu-manager-own-node"]
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert variables["podStateAnnotations"] == (
        "request.resource.resource == 'pods' ? variables.changedAnnotations.filter(k, k.startsWith('qgpu.io/') "
        "&& !(k in ['qgpu.io/assigned'])) : []")
    (check,) = [v for v in spec["validations"] if "podStateAnnotations" in v["expression"]]
    assert check["expression"] == "size(variables.podStateAnnotations) == 0"
    assert "on a pod the node manager changes only ' + 'qgpu.io/assigned (the containers it served)" in check["messageExpression"]
    # a Node's qgpu.io/ labels and annotations stay the manager's to write
    assert variables["foreignAnnotations"] == "variables.changedAnnotations.filter(k, !k.startsWith('qgpu.io/'))"


def test_a_nodes_kubelet_changes_no_qgpu_annotation_of_a_pod_on_any_update():
    spec = policies()["qgpu-kubelet-pod-annotations"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods", "pods/*"]}]
    assert spec["matchConditions"] == [{"name": "is-a-node", "expression": "'system:nodes' in request.userInfo.groups"}]
    assert [v["expression"] for v in spec["validations"]] == ["size(variables.changed) == 0"]
    assert "filter(k, k.startsWith('qgpu.io/'))" in {v["name"]: v["expression"] for v in spec["variables"]}["changed"]


def test_both_come_with_the_managers_admission_policy_and_neither_without_it():
    assert {"qgpu-manager-own-node", "qgpu-kubelet-pod-annotations"} <= set(policies())
    assert set(policies(qgpu_manager_dra=True)) == {"qgpu-manager-own-node", "qgpu-kubelet-pod-annotations",
                                                    "qgpu-slices-own-pool"}
    assert policies(qgpu_manager_admission_policy=False) == {}


def test_the_bound_gpu_pod_refusal_names_the_first_resource_asked_in_name_order():
    """Not the first key of a map, whose order CEL does not fix (tests/k8s/test_e2e_least_privilege.py
    holds the apiserver to it)."""
    (policy,) = [d for d in render_template("qgpu-scheduler.yaml.j2")
                 if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == "qgpu-pod-placed-by-extender"]
    (message,) = [v["messageExpression"] for v in policy["spec"]["validations"]]
    assert "' and GPU resource ' + variables.asked.map(names, names.min()).min() + ' by '" in message
    assert "[0][0]" not in message
