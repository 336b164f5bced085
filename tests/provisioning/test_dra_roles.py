"""The provisioning side of qgpu as a DRA driver (issue 13 §3, §6): the pool mode variable, the
manager manifest of each mode, the DeviceClasses, the refusals, the preflight's mode check and
containerd's CDI drop-in, each rendered or run by the roles on this machine (no cluster needed)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from ansible_tools import BIN, REPO, Run, run_tool

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
    assert "RUNNING HANDLER [qgpu_node_pool : Restart containerd]" in first.output
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
