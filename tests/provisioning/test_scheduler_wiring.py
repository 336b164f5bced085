"""The pure part of kube_scheduler_extender: which config format each kube-scheduler reads, and
how the kubeadm static pod is wired and unwired (roles/kube_scheduler_extender/filter_plugins)."""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
from ansible.errors import AnsibleFilterError
from ansible_tools import REPO

_spec = importlib.util.spec_from_file_location(
    "scheduler_wiring", REPO / "roles/kube_scheduler_extender/filter_plugins/scheduler_wiring.py")
assert _spec and _spec.loader
wiring = importlib.util.module_from_spec(_spec)
sys.modules["scheduler_wiring"] = wiring  # dataclasses look their module up while decorating
_spec.loader.exec_module(wiring)

CONFIG_DIR = "/etc/kubernetes/qgpu"
KSC = f"{CONFIG_DIR}/kube-scheduler-config.yaml"
POLICY = f"{CONFIG_DIR}/scheduler-policy.json"


def kubeadm_manifest(version: str = "1.28.15") -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "kube-scheduler", "namespace": "kube-system", "labels": {"component": "kube-scheduler"}},
        "spec": {
            "containers": [{
                "name": "kube-scheduler",
                "image": f"registry.k8s.io/kube-scheduler:v{version}",
                "command": ["kube-scheduler", "--kubeconfig=/etc/kubernetes/scheduler.conf", "--leader-elect=true"],
                "volumeMounts": [{"name": "kubeconfig", "mountPath": "/etc/kubernetes/scheduler.conf", "readOnly": True}],
            }],
            "hostNetwork": True,
            "volumes": [{"name": "kubeconfig", "hostPath": {"path": "/etc/kubernetes/scheduler.conf", "type": "FileOrCreate"}}],
        },
    }


@pytest.mark.parametrize("version, expected", [
    ("1.14.10", "policy"), ("1.17.17", "policy"), ("1.18.20", "policy"),
    ("1.19.16", "v1beta1"), ("1.21.14", "v1beta1"),
    ("1.22.17", "v1beta2"),
    ("1.23.17", "v1beta3"), ("1.24.17", "v1beta3"),
    ("1.25.16", "v1"), ("1.28.15", "v1"), ("1.31.0", "v1"), ("v1.30.4", "v1"), ("1.22.5-tke.8", "v1beta2"),
])
def test_auto_picks_the_format_each_version_reads(version: str, expected: str) -> None:
    assert wiring.scheduler_config_format(version) == expected


@pytest.mark.parametrize("version, requested", [
    ("1.22.17", "policy"), ("1.22.17", "v1beta1"), ("1.23.0", "v1beta2"), ("1.27.3", "v1beta2"),
    ("1.28.1", "v1beta3"), ("1.25.0", "v1"), ("1.18.3", "policy"),
])
def test_a_forced_format_within_its_span_is_kept(version: str, requested: str) -> None:
    assert wiring.scheduler_config_format(version, requested) == requested


@pytest.mark.parametrize("version, requested, readable", [
    ("1.23.0", "policy", "v1beta2, v1beta3"),
    ("1.18.20", "v1beta1", "policy"),
    ("1.28.0", "v1beta2", "v1beta3, v1"),
    ("1.29.0", "v1beta3", "v1"),
    ("1.24.0", "v1", "v1beta2, v1beta3"),
])
def test_a_forced_format_the_version_cannot_read_is_refused_naming_both(version: str, requested: str, readable: str) -> None:
    with pytest.raises(AnsibleFilterError) as err:
        wiring.scheduler_config_format(version, requested)
    assert f"{requested!r}: kube-scheduler {version} cannot read it" in str(err.value)
    assert f"{version} reads {readable}" in str(err.value)


def test_versions_before_1_14_and_garbage_are_refused() -> None:
    with pytest.raises(AnsibleFilterError, match="supports Kubernetes 1.14 and later"):
        wiring.scheduler_config_format("1.13.12")
    with pytest.raises(AnsibleFilterError, match="expected MAJOR.MINOR"):
        wiring.scheduler_config_format("latest")
    with pytest.raises(AnsibleFilterError, match="choose auto or one of policy, v1beta1"):
        wiring.scheduler_config_format("1.28.0", "v1alpha1")


def test_the_version_comes_from_the_image_tag_even_with_a_registry_port() -> None:
    manifest = kubeadm_manifest("1.24.17")
    assert wiring.scheduler_version_from_manifest(manifest) == "1.24.17"
    manifest["spec"]["containers"][0]["image"] = "registry.local:5000/k8s/kube-scheduler:v1.22.5-tke.8"
    assert wiring.scheduler_version_from_manifest(manifest) == "1.22.5-tke.8"
    manifest["spec"]["containers"][0]["image"] = "registry.local:5000/kube-scheduler"
    with pytest.raises(AnsibleFilterError, match="no version tag; set kube_scheduler_extender_kubernetes_version"):
        wiring.scheduler_version_from_manifest(manifest)


def test_wiring_adds_args_mount_volume_and_checksum_and_keeps_kubeadm_flags() -> None:
    original = kubeadm_manifest()
    wired = wiring.scheduler_wire(original, "v1", KSC, CONFIG_DIR, "abc")
    container = wired["spec"]["containers"][0]
    assert container["command"] == original["spec"]["containers"][0]["command"]
    assert container["args"] == [f"--config={KSC}"]
    assert {"name": "qgpu-scheduler-config", "mountPath": CONFIG_DIR, "readOnly": True} in container["volumeMounts"]
    assert {"name": "qgpu-scheduler-config", "hostPath": {"path": CONFIG_DIR, "type": "DirectoryOrCreate"}} in wired["spec"]["volumes"]
    assert wired["metadata"]["annotations"] == {"qgpu.io/scheduler-config-checksum": "abc"}
    assert original == kubeadm_manifest(), "the input manifest is not modified"


def test_wiring_twice_is_a_fixed_point_and_only_the_checksum_moves() -> None:
    once = wiring.scheduler_wire(kubeadm_manifest(), "v1", KSC, CONFIG_DIR, "abc")
    assert wiring.scheduler_wire(once, "v1", KSC, CONFIG_DIR, "abc") == once
    changed = wiring.scheduler_wire(once, "v1", KSC, CONFIG_DIR, "def")
    expected = copy.deepcopy(once)
    expected["metadata"]["annotations"]["qgpu.io/scheduler-config-checksum"] = "def"
    assert changed == expected


def test_switching_from_policy_to_config_replaces_the_flags() -> None:
    policy = wiring.scheduler_wire(kubeadm_manifest("1.22.17"), "policy", POLICY, CONFIG_DIR, "abc")
    assert policy["spec"]["containers"][0]["args"] == [f"--policy-config-file={POLICY}", "--use-legacy-policy-config=true"]
    upgraded = wiring.scheduler_wire(policy, "v1beta3", KSC, CONFIG_DIR, "def")
    assert upgraded["spec"]["containers"][0]["args"] == [f"--config={KSC}"]
    assert [v["name"] for v in upgraded["spec"]["volumes"]].count("qgpu-scheduler-config") == 1


def test_a_foreign_config_flag_is_not_replaced() -> None:
    manifest = kubeadm_manifest()
    manifest["spec"]["containers"][0]["command"].append("--config=/etc/kubernetes/my-scheduler.yaml")
    with pytest.raises(AnsibleFilterError, match="command already has --config=/etc/kubernetes/my-scheduler.yaml"):
        wiring.scheduler_wire(manifest, "v1", KSC, CONFIG_DIR, "abc")


def test_an_operators_legacy_policy_configmap_is_refused_not_dropped() -> None:
    """Before 1.23 a scheduling policy could come from a ConfigMap; the wiring dropped the flags
    and kube-scheduler silently lost the operator's policy."""
    manifest = kubeadm_manifest("1.21.0")
    manifest["spec"]["containers"][0]["command"] += ["--policy-configmap=ops-scheduler-policy",
                                                     "--policy-configmap-namespace=kube-system"]
    with pytest.raises(AnsibleFilterError, match="command already has --policy-configmap=ops-scheduler-policy; qgpu will "
                                                 "not replace a configuration it did not write"):
        wiring.scheduler_wire(manifest, "policy", POLICY, CONFIG_DIR, "abc")


def test_is_wired_sees_regenerated_manifests_as_drift() -> None:
    wired = wiring.scheduler_wire(kubeadm_manifest(), "v1", KSC, CONFIG_DIR, "abc")
    assert wiring.scheduler_is_wired(wired, "v1", KSC, CONFIG_DIR)
    assert not wiring.scheduler_is_wired(kubeadm_manifest("1.29.0"), "v1", KSC, CONFIG_DIR)
    assert not wiring.scheduler_is_wired(wired, "policy", POLICY, CONFIG_DIR)


def test_unwiring_restores_the_kubeadm_manifest() -> None:
    for config_format, path in (("v1", KSC), ("policy", POLICY)):
        wired = wiring.scheduler_wire(kubeadm_manifest(), config_format, path, CONFIG_DIR, "abc")
        assert wiring.scheduler_unwire(wired, CONFIG_DIR) == kubeadm_manifest()


@pytest.mark.parametrize("version,has_dra", [("1.33.5", False), ("v1.34.0", True), ("1.37.2", True),
                                             ("1.25.16", False), ("1.34.1-tke.1", True)])
def test_dra_exists_from_kubernetes_1_34(version: str, has_dra: bool) -> None:
    """kube_scheduler_extender adds the DRA prioritize entry only where kube-scheduler allocates claims."""
    assert wiring.scheduler_has_dra(version) is has_dra
