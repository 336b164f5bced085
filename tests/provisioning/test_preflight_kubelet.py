"""gpu_preflight compares the node with the kubelet the inventory plans (gpu_preflight_kubelet_version):
kubelet >= 1.35 refuses cgroup v1 unless failCgroupV1 is false (TencentOS 3.1 boots cgroup v1),
kubelet 1.37 flags containerd 1.x (kubelet_cri_losing_support) and 1.38 refuses it.

The node is a fixture: /sys/fs/cgroup under gpu_preflight_probe_root, and a fake `containerd` first
on PATH printing what a real one prints for `--version`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from ansible_tools import BIN, REPO, Run, run_tool

PLAYBOOK = REPO / "tests/provisioning/playbooks/preflight.yml"
# `containerd --version` of real builds: Debian bookworm's 1.6, upstream 1.7, upstream 2.1.
CONTAINERD_1_6 = "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3"
CONTAINERD_1_7 = "containerd github.com/containerd/containerd v1.7.27 05044ec0a9a75232cad458027ca83437aae3f4da"
CONTAINERD_2_1 = "containerd github.com/containerd/containerd/v2 v2.1.4 75cb2b7193e4e490e9fbdc236c0e811ccaba3376"


def fake_node(tmp_path: Path, cgroup: str, containerd: str | None = None) -> Path:
    """A probe root with a cgroup v1 (per-controller directories) or v2 (unified) /sys/fs/cgroup,
    and, when given, a `containerd` on tmp_path/bin that answers --version with `containerd`."""
    root = tmp_path / "node"
    cgroup_fs = root / "sys/fs/cgroup"
    if cgroup == "v2":
        cgroup_fs.mkdir(parents=True)
        (cgroup_fs / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    else:
        for controller in ("cpu,cpuacct", "memory", "pids", "devices", "systemd"):
            (cgroup_fs / controller).mkdir(parents=True)
    if containerd is not None:
        fake = tmp_path / "bin/containerd"
        fake.parent.mkdir()
        fake.write_text(f"#!/bin/sh\necho '{containerd}'\n")
        fake.chmod(0o755)
    return root


def preflight(tmp_path: Path, node: Path, checks: list[str], **role_vars: Any) -> tuple[Run, dict[str, dict[str, Any]]]:
    results = tmp_path / "results.json"
    extra = {"gpu_preflight_probe_root": str(node), "gpu_preflight_checks": checks, "results_file": str(results),
             **role_vars}
    run = run_tool([str(BIN / "ansible-playbook"), "-i", "localhost,", str(PLAYBOOK), "-e", json.dumps(extra)],
                   PATH=f"{BIN}{os.pathsep}{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    by_check = {r["check"]: r for r in json.loads(results.read_text())} if results.exists() else {}
    return run, by_check


def one_line(text: str) -> str:
    return " ".join(text.split())


# --- cgroup ----------------------------------------------------------------------------------------

def test_enforce_fails_on_cgroup_v1_for_kubelet_1_35_naming_versions_and_both_fixes(tmp_path: Path) -> None:
    run, _ = preflight(tmp_path, fake_node(tmp_path, "v1"), ["cgroup"], gpu_preflight_kubelet_version="1.35.2")
    assert run.returncode != 0
    failure = one_line(run.output.split("TASK [gpu_preflight : Stop on failed preflight checks")[1])
    assert "cgroup: localhost boots cgroup v1" in failure
    assert "kubelet 1.35.2 refuses to start on cgroup v1" in failure
    assert "systemd.unified_cgroup_hierarchy=1" in failure
    assert "set failCgroupV1: false in the KubeletConfiguration" in failure
    assert "deprecated" in failure


def test_report_mode_prints_the_cgroup_failure_and_goes_on(tmp_path: Path) -> None:
    run, results = preflight(tmp_path, fake_node(tmp_path, "v1"), ["cgroup"], gpu_preflight_mode="report",
                             gpu_preflight_kubelet_version="v1.36.0")
    assert run.returncode == 0, run.output[-3000:]
    assert "FAIL cgroup: localhost boots cgroup v1" in run.output
    assert results["cgroup"]["ok"] is False


def test_fail_cgroup_v1_false_lets_cgroup_v1_pass_with_a_deprecation_warning(tmp_path: Path) -> None:
    run, results = preflight(tmp_path, fake_node(tmp_path, "v1"), ["cgroup"], gpu_preflight_kubelet_version="1.35.2",
                             gpu_preflight_kubelet_fail_cgroup_v1=False)
    assert run.returncode == 0, run.output[-3000:]
    assert (results["cgroup"]["ok"], results["cgroup"]["warn"]) == (True, True)
    assert "WARN cgroup: cgroup v1" in run.output
    assert "only because its KubeletConfiguration sets failCgroupV1: false" in one_line(results["cgroup"]["detail"])


@pytest.mark.parametrize("cgroup, kubelet, warn", [("v2", "1.35.2", False), ("v2", "1.38.0", False), ("v1", "1.34.3", True)])
def test_cgroup_passes_where_the_kubelet_runs(tmp_path: Path, cgroup: str, kubelet: str, warn: bool) -> None:
    run, results = preflight(tmp_path, fake_node(tmp_path, cgroup), ["cgroup"], gpu_preflight_kubelet_version=kubelet)
    assert run.returncode == 0, run.output[-3000:]
    assert (results["cgroup"]["ok"], results["cgroup"]["warn"]) == (True, warn)


# --- containerd ------------------------------------------------------------------------------------

@pytest.mark.parametrize("containerd, version", [(CONTAINERD_1_6, "1.6.20"), (CONTAINERD_1_7, "1.7.27")])
def test_enforce_fails_on_containerd_1_for_kubelet_1_38(tmp_path: Path, containerd: str, version: str) -> None:
    run, _ = preflight(tmp_path, fake_node(tmp_path, "v2", containerd), ["containerd_version"],
                       gpu_preflight_kubelet_version="1.38.1")
    assert run.returncode != 0
    failure = one_line(run.output.split("TASK [gpu_preflight : Stop on failed preflight checks")[1])
    assert (f"containerd_version: localhost runs containerd {version} and kubelet 1.38.1 no longer supports "
            "containerd 1.x") in failure
    assert "upgrade containerd to 2.x" in failure


def test_kubelet_1_37_warns_about_containerd_1_without_failing(tmp_path: Path) -> None:
    run, results = preflight(tmp_path, fake_node(tmp_path, "v2", CONTAINERD_1_7), ["containerd_version"],
                             gpu_preflight_kubelet_version="1.37.2")
    assert run.returncode == 0, run.output[-3000:]
    assert (results["containerd_version"]["ok"], results["containerd_version"]["warn"]) == (True, True)
    assert "kubelet_cri_losing_support" in results["containerd_version"]["detail"]
    assert "WARN containerd_version: containerd 1.7.27 with kubelet 1.37.2" in run.output


@pytest.mark.parametrize("containerd, kubelet", [(CONTAINERD_2_1, "1.38.1"), (CONTAINERD_1_7, "1.36.4")])
def test_containerd_passes_where_the_kubelet_supports_it(tmp_path: Path, containerd: str, kubelet: str) -> None:
    run, results = preflight(tmp_path, fake_node(tmp_path, "v2", containerd), ["containerd_version"],
                             gpu_preflight_kubelet_version=kubelet)
    assert run.returncode == 0, run.output[-3000:]
    assert (results["containerd_version"]["ok"], results["containerd_version"]["warn"]) == (True, False)
    assert "PASS containerd_version" in run.output


def test_a_node_without_containerd_fails_saying_what_was_run(tmp_path: Path) -> None:
    run, results = preflight(tmp_path, fake_node(tmp_path, "v2"), ["containerd_version"], gpu_preflight_mode="report",
                             gpu_preflight_kubelet_version="1.38.1",
                             gpu_preflight_containerd_binary=str(tmp_path / "missing/containerd"))
    assert run.returncode == 0, run.output[-3000:]
    assert results["containerd_version"]["ok"] is False
    assert f"no containerd version from `{tmp_path}/missing/containerd --version`" in one_line(results["containerd_version"]["detail"])


def test_without_a_planned_kubelet_both_checks_only_report_what_they_found(tmp_path: Path) -> None:
    run, results = preflight(tmp_path, fake_node(tmp_path, "v1", CONTAINERD_1_6), ["cgroup", "containerd_version"])
    assert run.returncode == 0, run.output[-3000:]
    assert all(r["ok"] for r in results.values())
    assert "gpu_preflight_kubelet_version is not set" in results["cgroup"]["detail"]
    assert "containerd 1.6.20; gpu_preflight_kubelet_version is not set" in one_line(results["containerd_version"]["detail"])
