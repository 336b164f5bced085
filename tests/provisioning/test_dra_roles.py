"""The provisioning side of qgpu as a DRA driver (issue 13 §3, §6): the pool mode variable, the
manager manifest of each mode, the DeviceClasses, the refusals, the preflight's mode check and
containerd's CDI drop-in, each rendered or run by the roles on this machine (no cluster needed)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_tools import BIN, REPO, Run, run_tool

from qgpu_runtime.contract import dra, names

NODE_POOL_PLAYBOOK = REPO / "tests/provisioning/playbooks/node-pool-cdi.yml"

MAIN_V3 = """\
version = 3
imports = ["/etc/containerd/other.d/*.toml"]
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
"""


def playbook(path: Path, **extra: Any) -> Run:
    return run_tool([str(BIN / "ansible-playbook"), "-i", "localhost,", str(path), "-e", json.dumps(extra)])


def one_line(text: str) -> str:
    return " ".join(text.split())


# --- containerd CDI on dra pools ------------------------------------------------------------------

def sandbox_node(root: Path, main: str | None = MAIN_V3) -> None:
    (root / "etc/containerd").mkdir(parents=True)
    if main is not None:
        (root / "etc/containerd/config.toml").write_text(main)


def test_a_dra_pool_gets_cdi_in_containerd_and_a_second_run_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sandbox_node(root)
    first = playbook(NODE_POOL_PLAYBOOK, qgpu_root_prefix=str(root), qgpu_pool_mode="dra",
                     qgpu_node_pool_containerd_version="2.4.2")
    assert first.returncode == 0, first.output[-4000:]
    dropin = tomllib.loads((root / "etc/containerd/conf.d/90-qgpu-cdi.toml").read_text())
    assert dropin == {"version": 3, "plugins": {"io.containerd.cri.v1.runtime": {
        "enable_cdi": True, "cdi_spec_dirs": ["/etc/cdi", "/var/run/cdi"]}}}
    main = tomllib.loads((root / "etc/containerd/config.toml").read_text())
    assert main["imports"] == ["/etc/containerd/other.d/*.toml", "/etc/containerd/conf.d/*.toml"]
    assert main["plugins"]["io.containerd.cri.v1.runtime"] == {"restrict_oom_score_adj": True}
    assert "RUNNING HANDLER [qgpu_node_pool : Restart containerd to load the CDI settings]" in first.output
    plan = json.loads((root / "var/lib/qgpu/provisioning/node-pool/gpu-dra-1.json").read_text())
    assert plan["metadata"]["labels"]["qgpu.io/pool-mode"] == "dra"

    second = playbook(NODE_POOL_PLAYBOOK, qgpu_root_prefix=str(root), qgpu_pool_mode="dra",
                      qgpu_node_pool_containerd_version="2.4.2")
    assert second.returncode == 0, second.output[-4000:]
    assert second.recap_changed() == 0, second.output[-4000:]
    assert "RUNNING HANDLER" not in second.output


def test_a_node_without_a_containerd_config_gets_a_schema_3_one_importing_the_dropin(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sandbox_node(root, main=None)
    run = playbook(NODE_POOL_PLAYBOOK, qgpu_root_prefix=str(root), qgpu_pool_mode="dra",
                   qgpu_node_pool_containerd_version="v2.1.4")
    assert run.returncode == 0, run.output[-4000:]
    assert tomllib.loads((root / "etc/containerd/config.toml").read_text()) == {
        "version": 3, "imports": ["/etc/containerd/conf.d/*.toml"]}


def test_a_device_plugin_pool_leaves_containerd_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sandbox_node(root)
    run = playbook(NODE_POOL_PLAYBOOK, qgpu_root_prefix=str(root), qgpu_node_pool_containerd_version="1.6.20")
    assert run.returncode == 0, run.output[-4000:]
    assert (root / "etc/containerd/config.toml").read_text() == MAIN_V3
    assert not (root / "etc/containerd/conf.d").exists()
    plan = json.loads((root / "var/lib/qgpu/provisioning/node-pool/gpu-dra-1.json").read_text())
    assert plan["metadata"]["labels"]["qgpu.io/pool-mode"] == "device-plugin"


@pytest.mark.parametrize("version", ["1.6.20", "1.7.27"])
def test_a_dra_pool_refuses_containerd_1x_naming_the_version(tmp_path: Path, version: str) -> None:
    root = tmp_path / "root"
    sandbox_node(root)
    run = playbook(NODE_POOL_PLAYBOOK, qgpu_root_prefix=str(root), qgpu_pool_mode="dra",
                   qgpu_node_pool_containerd_version=version)
    assert run.returncode != 0
    assert f"qgpu_pool_mode dra needs CDI in containerd, and containerd {version} has none" in one_line(run.output)
    assert "upgrade containerd to 2.x" in one_line(run.output)
    assert (root / "etc/containerd/config.toml").read_text() == MAIN_V3
    assert not (root / "var/lib/qgpu/provisioning/node-pool").exists()


def test_an_unknown_pool_mode_is_refused_naming_variable_value_and_allowed_values(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sandbox_node(root)
    run = playbook(NODE_POOL_PLAYBOOK, qgpu_root_prefix=str(root), qgpu_pool_mode="dynamic")
    assert run.returncode != 0
    assert 'qgpu_pool_mode "dynamic" is not allowed; allowed values: device-plugin, dra' in one_line(run.output)


# --- the manager manifest of each mode ------------------------------------------------------------

RENDER_MANAGER = REPO / "tests/provisioning/playbooks/render-manager.yml"
POLICIES = ("best-effort", "fixed-share", "burst-share")


def manager_inventory(path: Path, pools: dict[str, tuple[list[str], dict[str, Any]]]) -> Path:
    """An inventory shaped like inventories/example: pools as children of qgpu_gpu_nodes, each with
    its group vars; localhost renders."""
    inventory = {"all": {"children": {
        "qgpu_kube_api": {"hosts": {"localhost": None}},
        "qgpu_gpu_nodes": {"children": {pool: {"hosts": {h: None for h in hosts}, "vars": group_vars}
                                        for pool, (hosts, group_vars) in pools.items()}},
    }}}
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path


def render_manager(tmp_path: Path, pools: dict[str, tuple[list[str], dict[str, Any]]], **extra: Any) -> tuple[Run, list[dict[str, Any]]]:
    root = tmp_path / "root"
    inventory = manager_inventory(tmp_path / "hosts.yml", pools)
    run = run_tool([str(BIN / "ansible-playbook"), "-i", str(inventory), str(RENDER_MANAGER),
                    "-e", json.dumps({"qgpu_root_prefix": str(root), **extra})])
    manifest = root / "etc/qgpu/manifests/qgpu-manager.yaml"
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d] if run.returncode == 0 else []
    return run, docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


MIXED_MODES = {
    "qgpu_pool_training": (["gpu-v100-1"], {"qgpu_node_pool_isolation_policy": "fixed-share"}),
    "qgpu_pool_dra": (["gpu-dra-1", "gpu-dra-2"], {"qgpu_node_pool_isolation_policy": "burst-share", "qgpu_pool_mode": "dra"}),
}


@pytest.fixture(scope="module")
def device_plugin_only(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    run, docs = render_manager(tmp_path_factory.mktemp("dp"), {
        "qgpu_pool_training": (["gpu-v100-1"], {"qgpu_node_pool_isolation_policy": "fixed-share"})})
    assert run.returncode == 0, run.output[-4000:]
    return docs


@pytest.fixture(scope="module")
def mixed_modes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    run, docs = render_manager(tmp_path_factory.mktemp("mixed"), MIXED_MODES)
    assert run.returncode == 0, run.output[-4000:]
    return docs


def test_without_a_dra_pool_the_manifest_has_no_dra_object(device_plugin_only: list[dict[str, Any]]) -> None:
    assert not by_kind(device_plugin_only, "DeviceClass")
    assert set(by_kind(device_plugin_only, "ServiceAccount")) == {"qgpu-manager"}
    daemonsets = by_kind(device_plugin_only, "DaemonSet")
    assert set(daemonsets) == {f"qgpu-manager-{p}" for p in POLICIES}
    for ds in daemonsets.values():
        pod = ds["spec"]["template"]["spec"]
        assert "affinity" not in pod  # today's DaemonSet, unchanged
        assert "--dra" not in pod["containers"][0]["args"]
    policy = by_kind(device_plugin_only, "ValidatingAdmissionPolicy")["qgpu-manager-own-node"]
    assert [r["resources"] for r in policy["spec"]["matchConstraints"]["resourceRules"]] == [["nodes", "nodes/status", "pods"]]


def test_the_device_classes_are_exactly_the_contracts(mixed_modes: list[dict[str, Any]]) -> None:
    rendered = [d for d in mixed_modes if d["kind"] == "DeviceClass"]
    for d in rendered:
        assert d["metadata"].pop("labels")["app.kubernetes.io/part-of"] == "qgpu"
    assert rendered == dra.device_classes()


def test_dra_pools_get_a_dra_manager_on_their_nodes_only(mixed_modes: list[dict[str, Any]]) -> None:
    daemonsets = by_kind(mixed_modes, "DaemonSet")
    assert set(daemonsets) == {f"qgpu-manager-{p}" for p in POLICIES} | {f"qgpu-manager-dra-{p}" for p in POLICIES}
    for policy in POLICIES:
        pod = daemonsets[f"qgpu-manager-dra-{policy}"]["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "qgpu-manager-dra"
        assert pod["nodeSelector"] == {names.DEVICE_ENABLE_LABEL: "enable", names.ISOLATION_POLICY_LABEL: policy,
                                       names.POOL_MODE_LABEL: "dra"}
        container = pod["containers"][0]
        assert container["command"] == ["qgpu", "manager", "serve"]
        assert "--dra" in container["args"]
        assert "--dra-unhealthy-effect=NoSchedule" in container["args"]  # the default: running pods stay
        assert not [a for a in container["args"] if a.startswith(("--resources", "--device-plugin-dir", "--pod-resources"))]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        # kubelet's plugin folder only where qgpu's socket lives: other drivers' sockets are not mounted
        assert {"/var/lib/kubelet/plugins/gpu.qgpu.io", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"} <= mounts
        assert "/var/lib/kubelet/plugins" not in mounts
        paths = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
        assert paths["kubelet-plugins"] == "/var/lib/kubelet/plugins/gpu.qgpu.io"
        assert "/var/lib/kubelet/device-plugins" not in mounts
        ds = daemonsets[f"qgpu-manager-dra-{policy}"]
        assert ds["spec"]["selector"]["matchLabels"][names.POOL_MODE_LABEL] == "dra"
        assert ds["spec"]["template"]["metadata"]["labels"][names.POOL_MODE_LABEL] == "dra"


def test_device_plugin_daemonsets_keep_off_dra_nodes(mixed_modes: list[dict[str, Any]]) -> None:
    daemonsets = by_kind(mixed_modes, "DaemonSet")
    for policy in POLICIES:
        pod = daemonsets[f"qgpu-manager-{policy}"]["spec"]["template"]["spec"]
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [{"key": names.POOL_MODE_LABEL, "operator": "NotIn", "values": ["dra"]}]}]
        assert "--dra" not in pod["containers"][0]["args"]
        assert pod["serviceAccountName"] == "qgpu-manager"


def test_pools_with_different_resource_lists_beside_a_dra_pool_select_both_ways(tmp_path: Path) -> None:
    run, docs = render_manager(tmp_path, {**MIXED_MODES, "qgpu_pool_inference": (
        ["gpu-t4-1"], {"qgpu_manager_device_resources": ["tke.cloud.tencent.com/qgpu-core", "tke.cloud.tencent.com/qgpu-memory"]})})
    assert run.returncode == 0, run.output[-4000:]
    narrowed = [d for d in by_kind(docs, "DaemonSet").values()
                if d["metadata"]["name"].startswith("qgpu-manager-best-effort-")]
    assert len(narrowed) == 1
    terms = narrowed[0]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": names.POOL_MODE_LABEL, "operator": "NotIn", "values": ["dra"]}],
                      "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-t4-1"]}]}]


def test_the_dra_manager_may_publish_slices_and_read_claims_nothing_more(mixed_modes: list[dict[str, Any]]) -> None:
    role = by_kind(mixed_modes, "ClusterRole")["qgpu-manager-dra"]
    dra_rules = [r for r in role["rules"] if r["apiGroups"] == ["resource.k8s.io"]]
    assert dra_rules == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
         "verbs": ["create", "get", "list", "watch", "update", "delete"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]}]
    base = by_kind(mixed_modes, "ClusterRole")["qgpu-manager"]
    assert not [r for r in base["rules"] if r["apiGroups"] == ["resource.k8s.io"]]
    # the core rules are the device-plugin manager's: its pods, its node, the node's status (the
    # QGPUSharesEnforced condition every manager sets), events
    assert [r for r in role["rules"] if r["apiGroups"] == [""]] == base["rules"]
    binding = by_kind(mixed_modes, "ClusterRoleBinding")["qgpu-manager-dra"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "qgpu-manager-dra", "namespace": "qgpu-system"}]


def test_the_admission_policy_holds_slice_writes_to_the_managers_node(mixed_modes: list[dict[str, Any]]) -> None:
    policy = by_kind(mixed_modes, "ValidatingAdmissionPolicy")["qgpu-manager-own-node"]["spec"]
    rules = policy["matchConstraints"]["resourceRules"]
    assert {"apiGroups": ["resource.k8s.io"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE", "DELETE"],
            "resources": ["resourceslices"]} in rules
    assert "system:serviceaccount:qgpu-system:qgpu-manager-dra" in policy["matchConditions"][0]["expression"]
    expressions = " ".join(v["expression"] for v in policy["validations"])
    assert "variables.sliceNodes.all(n, n == variables.node)" in expressions
    assert 'variables.sliceDriver == "gpu.qgpu.io"' in expressions


# --- refusals --------------------------------------------------------------------------------------

def test_a_node_in_pools_of_both_modes_is_refused(tmp_path: Path) -> None:
    run, _ = render_manager(tmp_path, {
        "qgpu_pool_a": (["gpu-a"], {"qgpu_node_pool_node_name": "gpu-1"}),
        "qgpu_pool_b": (["gpu-b"], {"qgpu_node_pool_node_name": "gpu-1", "qgpu_pool_mode": "dra"})})
    assert run.returncode != 0
    text = one_line(run.output)
    assert "Node gpu-1: the inventory hosts gpu-a, gpu-b put it in pools of different modes (device-plugin and dra)" in text
    assert not (tmp_path / "root/etc/qgpu/manifests/qgpu-manager.yaml").exists()


def test_a_dra_pool_with_nvidias_device_plugin_is_refused(tmp_path: Path) -> None:
    run, _ = render_manager(tmp_path, {"qgpu_pool_dra": (
        ["gpu-dra-1"], {"qgpu_pool_mode": "dra", "qgpu_manager_nvidia_device_plugin": True,
                        "qgpu_manager_device_resources": ["tke.cloud.tencent.com/qgpu-core"]})})
    assert run.returncode != 0
    text = one_line(run.output)
    assert "gpu-dra-1: qgpu_pool_mode is dra while qgpu_manager_nvidia_device_plugin is true" in text
    assert "the whole-card DeviceClass maps nvidia.com/gpu" in text


def test_the_manager_refuses_an_unknown_pool_mode(tmp_path: Path) -> None:
    run, _ = render_manager(tmp_path, {"qgpu_pool_x": (["gpu-x"], {"qgpu_pool_mode": "DRA"})})
    assert run.returncode != 0
    assert 'gpu-x: qgpu_pool_mode "DRA" is not allowed; allowed values: device-plugin, dra' in one_line(run.output)


def test_the_dra_manager_serves_in_the_folders_mounted_for_it(tmp_path: Path) -> None:
    """A kubelet with another root folder (`--root-dir=/data/kubelet`): the role mounted the folders
    it was told, but the manager served its sockets and wrote its CDI specs at its defaults, inside
    the container and outside every mount, so kubelet never saw the driver and containerd no spec."""
    dirs = {"qgpu_manager_kubelet_plugins_dir": "/data/kubelet/plugins",
            "qgpu_manager_kubelet_plugins_registry_dir": "/data/kubelet/plugins_registry",
            "qgpu_manager_cdi_dir": "/etc/cdi"}
    run, docs = render_manager(tmp_path, MIXED_MODES, **dirs)
    assert run.returncode == 0, run.output[-4000:]
    for policy in POLICIES:
        pod = by_kind(docs, "DaemonSet")[f"qgpu-manager-dra-{policy}"]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        args = dict(a.split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert args["--kubelet-plugins-dir"] == "/data/kubelet/plugins"
        assert f"{args['--kubelet-plugins-dir']}/gpu.qgpu.io" in mounts  # where the socket is made
        assert args["--plugins-registry-dir"] == "/data/kubelet/plugins_registry" in mounts
        assert args["--cdi-dir"] == "/etc/cdi" in mounts
        paths = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
        assert paths["kubelet-plugins"] == "/data/kubelet/plugins/gpu.qgpu.io"  # the same path on the host


def test_the_operator_can_have_an_unhealthy_cards_pods_evicted_on_dra_pools(tmp_path: Path) -> None:
    (tmp_path / "ok").mkdir()
    (tmp_path / "bad").mkdir()
    run, docs = render_manager(tmp_path / "ok", MIXED_MODES, qgpu_manager_dra_unhealthy_effect="NoExecute")
    assert run.returncode == 0, run.output[-4000:]
    daemonsets = by_kind(docs, "DaemonSet")
    assert all("--dra-unhealthy-effect=NoExecute" in daemonsets[f"qgpu-manager-dra-{p}"]["spec"]["template"]["spec"]["containers"][0]["args"]
               for p in POLICIES)
    run, _ = render_manager(tmp_path / "bad", MIXED_MODES, qgpu_manager_dra_unhealthy_effect="Evict")
    assert run.returncode != 0
    assert "qgpu_manager_dra_unhealthy_effect" in one_line(run.output) and "NoExecute" in one_line(run.output)


# --- the preflight: which modes the cluster supports ---------------------------------------------

PREFLIGHT = REPO / "tests/provisioning/playbooks/preflight.yml"


def preflight_pool_mode(tmp_path: Path, **role_vars: Any) -> tuple[Run, dict[str, Any]]:
    results = tmp_path / "results.json"
    run = playbook(PREFLIGHT, gpu_preflight_checks=["pool_mode"], results_file=str(results), **role_vars)
    found = {r["check"]: r for r in json.loads(results.read_text())} if results.exists() else {}
    return run, found.get("pool_mode", {})


@pytest.mark.parametrize("kubelet", ["1.34.0", "v1.37.2"])
def test_the_preflight_reports_both_modes_from_kubernetes_1_34(tmp_path: Path, kubelet: str) -> None:
    run, result = preflight_pool_mode(tmp_path, gpu_preflight_kubelet_version=kubelet, qgpu_pool_mode="dra")
    assert run.returncode == 0, run.output[-4000:]
    assert result["ok"] is True
    assert "supports: device-plugin, dra" in one_line(result["detail"])


def test_the_preflight_refuses_dra_below_kubernetes_1_34(tmp_path: Path) -> None:
    enforced, _ = preflight_pool_mode(tmp_path, gpu_preflight_kubelet_version="1.33.5", qgpu_pool_mode="dra")
    assert enforced.returncode != 0
    text = one_line(enforced.output)
    assert "pool_mode: localhost: qgpu_pool_mode dra needs Kubernetes 1.34 or later" in text
    assert "kubelet 1.33.5 supports only: device-plugin" in text
    reported, result = preflight_pool_mode(tmp_path, gpu_preflight_kubelet_version="1.33.5", qgpu_pool_mode="dra",
                                           gpu_preflight_mode="report")
    assert reported.returncode == 0, reported.output[-4000:]
    assert result["ok"] is False


def test_an_older_cluster_keeps_the_device_plugin_path(tmp_path: Path) -> None:
    run, result = preflight_pool_mode(tmp_path, gpu_preflight_kubelet_version="1.20.15")
    assert run.returncode == 0, run.output[-4000:]
    assert result["ok"] is True
    assert "qgpu_pool_mode device-plugin; kubelet 1.20.15 supports: device-plugin" in one_line(result["detail"])
