"""qgpu's prioritize for DRA pools, as the roles deploy it (issue 13 §5, §6), rendered on this
machine from inventories of pools in either qgpu_pool_mode (no cluster needed):

- qgpu_scheduler runs the extender with --dra-prioritize and adds exactly list and watch on
  ResourceSlices, ResourceClaims and ResourceClaimTemplates once any pool is dra; without a dra pool
  its manifest is exactly what it was;
- kube_scheduler_extender adds a second, prioritize-only and ignorable entry without
  managedResources (the only kind kube-scheduler calls for claim pods) for kube-scheduler >= 1.34,
  leaves today's entry as it was, and refuses an older kube-scheduler before any change.

The rendered KubeSchedulerConfiguration is loaded by a real kube-scheduler in
tests/provisioning/test_k8s_dra.py, which also checks the extender's RBAC on the real apiserver.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_tools import BIN, REPO, Run, run_tool

RENDER_SCHEDULER = REPO / "tests/provisioning/playbooks/render-scheduler.yml"
RENDER_CONFIGS = REPO / "tests/provisioning/playbooks/render-scheduler-configs.yml"
DRA_RULE = {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices", "resourceclaims", "resourceclaimtemplates"],
            "verbs": ["list", "watch"]}
DEVICE_PLUGIN_POOL = {"qgpu_pool_training": (["gpu-v100-1"], {"qgpu_node_pool_isolation_policy": "fixed-share"})}
MIXED_POOLS = {**DEVICE_PLUGIN_POOL, "qgpu_pool_dra": (["gpu-dra-1"], {"qgpu_pool_mode": "dra"})}
DRA_VERSIONS = ["1.34.3", "1.37.2"]


def inventory(path: Path, pools: dict[str, tuple[list[str], dict[str, Any]]]) -> Path:
    """Pools as children of qgpu_gpu_nodes, each with its group vars; localhost renders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    hosts = {"all": {"children": {
        "qgpu_kube_api": {"hosts": {"localhost": None}},
        "qgpu_gpu_nodes": {"children": {pool: {"hosts": {h: None for h in names}, "vars": group_vars}
                                        for pool, (names, group_vars) in pools.items()}},
    }}}
    path.write_text(yaml.safe_dump(hosts, sort_keys=False))
    return path


def render_scheduler(tmp_path: Path, pools: dict[str, tuple[list[str], dict[str, Any]]], **extra: Any) -> list[dict[str, Any]]:
    root = tmp_path / "root"
    run = run_tool([str(BIN / "ansible-playbook"), "-i", str(inventory(tmp_path / "hosts.yml", pools)),
                    str(RENDER_SCHEDULER), "-e", json.dumps({"qgpu_root_prefix": str(root), **extra})])
    assert run.returncode == 0, run.output[-4000:]
    return [d for d in yaml.safe_load_all((root / "etc/qgpu/manifests/qgpu-scheduler.yaml").read_text()) if d]


def render_configs(tmp_path: Path, pools: dict[str, tuple[list[str], dict[str, Any]]], versions: list[str],
                   **extra: Any) -> Run:
    return run_tool([str(BIN / "ansible-playbook"), "-i", str(inventory(tmp_path / "hosts.yml", pools)),
                     str(RENDER_CONFIGS), "-e", json.dumps({"sandbox": str(tmp_path / "masters"), "versions": versions,
                                                           **extra})])


def scheduler_config(tmp_path: Path, version: str) -> dict[str, Any]:
    return yaml.safe_load((tmp_path / "masters" / version / "etc/kubernetes/qgpu/kube-scheduler-config.yaml").read_text())


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def extender_args(docs: list[dict[str, Any]]) -> list[str]:
    return by_kind(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]


# --- qgpu_scheduler -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def extender_manifests(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return {"device-plugin": render_scheduler(tmp_path_factory.mktemp("dp"), DEVICE_PLUGIN_POOL),
            "mixed": render_scheduler(tmp_path_factory.mktemp("mixed"), MIXED_POOLS)}


def test_a_dra_pool_runs_the_extender_with_dra_prioritize(extender_manifests: dict[str, list[dict[str, Any]]]) -> None:
    assert "--dra-prioritize" in extender_args(extender_manifests["mixed"])
    assert "--dra-prioritize" not in extender_args(extender_manifests["device-plugin"])


def test_a_dra_pool_adds_exactly_list_and_watch_on_the_three_kinds(extender_manifests: dict[str, list[dict[str, Any]]]) -> None:
    without = by_kind(extender_manifests["device-plugin"], "ClusterRole")["rules"]
    with_dra = by_kind(extender_manifests["mixed"], "ClusterRole")["rules"]
    assert with_dra == without + [DRA_RULE]
    assert all(rule["apiGroups"] != ["resource.k8s.io"] for rule in without)


def test_without_a_dra_pool_the_manifest_is_what_it_was(extender_manifests: dict[str, list[dict[str, Any]]]) -> None:
    """The two renderings differ in exactly the DRA rule and the flag: take both out of the mixed
    one and the device-plugin one is left, object by object."""
    mixed = json.loads(json.dumps(extender_manifests["mixed"]))
    by_kind(mixed, "ClusterRole")["rules"].remove(DRA_RULE)
    extender_args(mixed).remove("--dra-prioritize")
    assert mixed == extender_manifests["device-plugin"]


def test_the_variable_decides_over_the_pools(tmp_path: Path) -> None:
    off = render_scheduler(tmp_path / "off", MIXED_POOLS, qgpu_dra_prioritize=False)
    assert "--dra-prioritize" not in extender_args(off)
    assert DRA_RULE not in by_kind(off, "ClusterRole")["rules"]
    on = render_scheduler(tmp_path / "on", DEVICE_PLUGIN_POOL, qgpu_scheduler_dra_prioritize=True)
    assert "--dra-prioritize" in extender_args(on)


# --- kube_scheduler_extender ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    rendered = {}
    for name, pools in (("device-plugin", DEVICE_PLUGIN_POOL), ("mixed", MIXED_POOLS)):
        path = tmp_path_factory.mktemp(name)
        run = render_configs(path, pools, DRA_VERSIONS)
        assert run.returncode == 0, run.output[-4000:]
        rendered[name] = path
    return rendered


@pytest.mark.parametrize("version", DRA_VERSIONS)
def test_a_dra_pool_adds_a_prioritize_only_entry_for_every_pod(configs: dict[str, Path], version: str) -> None:
    main, dra = scheduler_config(configs["mixed"], version)["extenders"]
    assert "managedResources" not in dra  # kube-scheduler calls an entry without them for every pod
    assert dra["prioritizeVerb"] == "dra-prioritize" and dra["filterVerb"] == "" and dra["bindVerb"] == ""
    assert "preemptVerb" not in dra
    assert dra["ignorable"] is True and dra["weight"] == 10 and dra["nodeCacheCapable"] is True
    # the same extender, reached the same way as today's entry
    for field in ("urlPrefix", "enableHTTPS", "tlsConfig", "httpTimeout"):
        assert dra[field] == main[field], field


@pytest.mark.parametrize("version", DRA_VERSIONS)
def test_todays_entry_is_unchanged_and_without_a_dra_pool_so_is_the_file(configs: dict[str, Path], version: str) -> None:
    (alone,) = scheduler_config(configs["device-plugin"], version)["extenders"]
    main, _ = scheduler_config(configs["mixed"], version)["extenders"]
    assert main == alone
    qgpu = Path("etc/kubernetes/qgpu/kube-scheduler-config.yaml")
    mixed_text = (configs["mixed"] / "masters" / version / qgpu).read_text()
    plain_text = (configs["device-plugin"] / "masters" / version / qgpu).read_text()
    assert mixed_text.startswith(plain_text)  # only appended to (no YAML anchor in today's entry either)


def test_the_device_plugin_file_matches_one_rendered_without_any_pool(configs: dict[str, Path], tmp_path: Path) -> None:
    """No GPU node group at all (today's -i localhost, renders) and a device-plugin pool: one file."""
    run = run_tool([str(BIN / "ansible-playbook"), "-i", "localhost,", str(RENDER_CONFIGS),
                    "-e", json.dumps({"sandbox": str(tmp_path / "masters"), "versions": DRA_VERSIONS})])
    assert run.returncode == 0, run.output[-4000:]
    for version in DRA_VERSIONS:
        assert scheduler_config(tmp_path, version) == scheduler_config(configs["device-plugin"], version)


def test_dra_prioritize_on_an_older_kube_scheduler_is_refused_before_any_change(tmp_path: Path) -> None:
    run = render_configs(tmp_path, MIXED_POOLS, ["1.33.5"])
    assert run.returncode != 0
    text = " ".join(run.output.split())
    assert "kube-scheduler is 1.33.5; DRA (resource.k8s.io/v1) needs Kubernetes 1.34 or later" in text, run.output[-4000:]
    assert not (tmp_path / "masters/1.33.5/etc/kubernetes/qgpu").exists()
