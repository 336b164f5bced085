"""The containers the templates render run as little as they can: the extender and the webhook as
nobody, read-only, no capability, no privilege escalation, the runtime's default seccomp filter;
the node manager without privilege by default, with only ``KILL`` and the same seccomp filter.
Real pods of these manifests: tests/realnode/test_e2e_deploy.py."""

from __future__ import annotations

from tests.k8s.rbac import render_template
from tests.provisioning.test_lease_policies_render import WEBHOOK


def _containers(docs: list[dict], kind: str) -> list[dict]:
    return [c for d in docs if d["kind"] == kind for c in d["spec"]["template"]["spec"]["containers"]]


def test_the_extender_and_the_webhook_run_as_nobody_read_only_with_nothing_extra():
    for containers in (_containers(render_template("qgpu-scheduler.yaml.j2"), "DaemonSet"),
                       _containers(render_template("qgpu-webhook.yaml.j2", **WEBHOOK), "Deployment")):
        assert containers
        for c in containers:
            assert c["securityContext"] == {
                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                "runAsUser": 65534, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}, c["name"]


def test_the_node_manager_is_unprivileged_with_only_kill_by_default():
    profile = {"resources": ["tke.cloud.tencent.com/qgpu-core"], "suffix": "", "nodes": None}
    containers = _containers(render_template("qgpu-manager.yaml.j2", qgpu_manager_profiles=[profile], qgpu_manager_dra=True),
                             "DaemonSet")
    assert len(containers) == 6  # three policies, device plugin and DRA each
    for c in containers:
        context = c["securityContext"]
        assert context.get("privileged", False) is False and context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_node_manager_mounts_kubelets_pod_resources_folder_read_only():
    """It only connects to kubelet's socket there (a read-only bind mount allows connect(2))."""
    profile = {"resources": ["tke.cloud.tencent.com/qgpu-core"], "suffix": "", "nodes": None}
    containers = _containers(render_template("qgpu-manager.yaml.j2", qgpu_manager_profiles=[profile]), "DaemonSet")
    mounts = [m for c in containers for m in c["volumeMounts"] if m["name"] == "pod-resources"]
    assert len(mounts) == 3 and all(m.get("readOnly") is True for m in mounts)
