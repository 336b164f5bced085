"""The nvidia_container_toolkit drop-in keeps the node's containerd CRI settings, asked of real
containerd: Debian's 1.6 (config schema 2) and v2.4.2 from scripts/containerd-bin (schema 3).

The role runs against a sandboxed GPU node (qgpu_root_prefix, a fixture PCI tree, no packages, no
services); then `containerd config dump` reads the written files at their real paths, inside a
private mount namespace where the sandbox's etc is bind-mounted over /etc.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError
from ansible_tools import BIN, REPO, run_tool

_spec = importlib.util.spec_from_file_location(
    "containerd_config", REPO / "roles/nvidia_container_toolkit/filter_plugins/containerd_config.py")
assert _spec and _spec.loader
containerd_config = importlib.util.module_from_spec(_spec)
sys.modules["containerd_config"] = containerd_config
_spec.loader.exec_module(containerd_config)

PLAYBOOK = REPO / "tests/provisioning/playbooks/nvidia-containerd.yml"
NVIDIA_BINARY = "/usr/bin/nvidia-container-runtime"

# A kubeadm-era node's own settings: none of them is containerd's default.
MAIN_V2 = """\
version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.example.com/pause:3.9"
  restrict_oom_score_adj = true
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "/opt/custom/cni/bin"
  conf_dir = "/etc/custom/cni/net.d"
[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "/etc/containerd/certs.d"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = true
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]
  runtime_type = "io.containerd.kata.v2"
"""

MAIN_V3 = """\
version = 3
[plugins."io.containerd.cri.v1.images"]
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "registry.example.com/pause:3.10"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "/etc/containerd/certs.d"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/opt/custom/cni/bin"]
    conf_dir = "/etc/custom/cni/net.d"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
      SystemdCgroup = true
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.kata]
    runtime_type = "io.containerd.kata.v2"
"""

# What the role rendered before: only the nvidia runtime, under the CRI plugin table.
OLD_DROPIN_V2 = """\
version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "nvidia"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
  privileged_without_host_devices = false
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
  BinaryName = "/usr/bin/nvidia-container-runtime"
  SystemdCgroup = true
"""


# --- containerd binaries -------------------------------------------------------------------------

@dataclass(frozen=True)
class Containerd:
    binary: Path
    schema: int

    def dump(self, sandbox_etc: Path) -> dict[str, Any]:
        """The effective config containerd builds from /etc/containerd/config.toml and its imports,
        with `sandbox_etc` standing in for /etc (a private mount namespace; the host is untouched)."""
        script = 'mount --bind "$1" /etc && exec "$2" --config /etc/containerd/config.toml config dump'
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                               str(sandbox_etc), str(self.binary)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, f"{self.binary} config dump failed:\n{proc.stderr[-3000:]}"
        return tomllib.loads(proc.stdout)


def _debian_containerd() -> Containerd:
    binary = shutil.which("containerd", path="/usr/bin")
    if binary is None:
        pytest.skip("Debian's containerd 1.6 is not installed: apt-get install -y --no-install-recommends containerd")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    assert " 1." in version, f"/usr/bin/containerd is not containerd 1.x: {version}"
    return Containerd(Path(binary), 2)


def _containerd_v2() -> Containerd:
    proc = subprocess.run([str(REPO / "scripts/containerd-bin")], capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, f"scripts/containerd-bin failed:\n{proc.stderr[-3000:]}"
    return Containerd(Path(proc.stdout.strip().splitlines()[-1]) / "containerd", 3)


def _require_mount_namespaces() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is needed to show containerd the sandbox at /etc")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here (needs root / CAP_SYS_ADMIN): {probe.stderr.strip()}")


@pytest.fixture(scope="module", params=["containerd-1.6", "containerd-2.4.2"])
def containerd(request: pytest.FixtureRequest) -> Containerd:
    _require_mount_namespaces()
    return _debian_containerd() if request.param == "containerd-1.6" else _containerd_v2()


# --- the sandboxed node --------------------------------------------------------------------------

def write_node(root: Path, main: str) -> None:
    """A GPU node (one T4 on the fixture PCI bus) whose containerd config another tool wrote."""
    pci = Path(f"{root}-probe/sys/bus/pci/devices/0000:3b:00.0")
    pci.mkdir(parents=True)
    for name, value in {"vendor": "0x10de", "class": "0x030200", "device": "0x1eb8"}.items():
        (pci / name).write_text(value + "\n")
    (root / "etc/containerd").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_text(main)


def run_role(root: Path, schema: int, **extra: Any) -> str:
    extra_vars = {"qgpu_root_prefix": str(root), "nvidia_container_toolkit_containerd_config_version": schema, **extra}
    run = run_tool([str(BIN / "ansible-playbook"), "-i", "localhost,", str(PLAYBOOK), "-e", json.dumps(extra_vars)])
    assert run.returncode == 0, run.output[-5000:]
    return run.output


def cri_sections(dump: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(runtime section, images section) of a dump: one table in 1.x, two in 2.x."""
    plugins = dump["plugins"]
    if "io.containerd.cri.v1.runtime" in plugins:  # 2.x still has a (small) io.containerd.grpc.v1.cri table
        return plugins["io.containerd.cri.v1.runtime"], plugins["io.containerd.cri.v1.images"]
    cri = plugins["io.containerd.grpc.v1.cri"]
    return cri, cri


def node_settings(dump: dict[str, Any]) -> dict[str, Any]:
    """The settings MAIN_V2 / MAIN_V3 chose, as containerd reports them."""
    runtime, images = cri_sections(dump)
    return {
        "sandbox": images.get("sandbox_image") or images.get("pinned_images", {}).get("sandbox"),
        "registry_config_path": images["registry"]["config_path"],
        "cni_bin": runtime["cni"].get("bin_dir") or runtime["cni"].get("bin_dirs"),
        "cni_conf_dir": runtime["cni"]["conf_dir"],
        "restrict_oom_score_adj": runtime["restrict_oom_score_adj"],
        "runc_systemd_cgroup": runtime["containerd"]["runtimes"].get("runc", {}).get("options", {}).get("SystemdCgroup"),
        "kata": runtime["containerd"]["runtimes"].get("kata", {}).get("runtime_type"),
    }


EXPECTED = {
    2: {"sandbox": "registry.example.com/pause:3.9", "registry_config_path": "/etc/containerd/certs.d",
        "cni_bin": "/opt/custom/cni/bin", "cni_conf_dir": "/etc/custom/cni/net.d", "restrict_oom_score_adj": True,
        "runc_systemd_cgroup": True, "kata": "io.containerd.kata.v2"},
    3: {"sandbox": "registry.example.com/pause:3.10", "registry_config_path": "/etc/containerd/certs.d",
        "cni_bin": ["/opt/custom/cni/bin"], "cni_conf_dir": "/etc/custom/cni/net.d", "restrict_oom_score_adj": True,
        "runc_systemd_cgroup": True, "kata": "io.containerd.kata.v2"},
}


# --- against real containerd ---------------------------------------------------------------------

def test_the_old_cri_only_dropin_wipes_the_node_settings_on_containerd_1x(tmp_path: Path) -> None:
    """Why the drop-in repeats the CRI table: containerd 1.x replaces the table, it does not merge."""
    _require_mount_namespaces()
    containerd = _debian_containerd()
    (tmp_path / "etc/containerd/conf.d").mkdir(parents=True)
    (tmp_path / "etc/containerd/config.toml").write_text('imports = ["/etc/containerd/conf.d/*.toml"]\n' + MAIN_V2)
    (tmp_path / "etc/containerd/conf.d/99-nvidia.toml").write_text(OLD_DROPIN_V2)
    settings = node_settings(containerd.dump(tmp_path / "etc"))
    assert settings["sandbox"] != EXPECTED[2]["sandbox"]
    assert settings["registry_config_path"] == ""
    assert settings["restrict_oom_score_adj"] is False
    assert settings["kata"] is None


def test_the_dropin_keeps_the_node_settings_and_adds_the_nvidia_runtime(containerd: Containerd, tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_node(root, MAIN_V2 if containerd.schema == 2 else MAIN_V3)
    run_role(root, containerd.schema)
    dump = containerd.dump(root / "etc")
    assert node_settings(dump) == EXPECTED[containerd.schema]
    runtime, _ = cri_sections(dump)
    nvidia = runtime["containerd"]["runtimes"]["nvidia"]
    assert (nvidia["runtime_type"], nvidia["options"]["BinaryName"]) == ("io.containerd.runc.v2", NVIDIA_BINARY)
    assert runtime["containerd"]["default_runtime_name"] == "nvidia"


def test_without_default_runtime_runc_stays_the_default(containerd: Containerd, tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_node(root, MAIN_V2 if containerd.schema == 2 else MAIN_V3)
    run_role(root, containerd.schema, nvidia_container_toolkit_default_runtime=False)
    runtime, _ = cri_sections(containerd.dump(root / "etc"))
    assert runtime["containerd"]["default_runtime_name"] == "runc"
    assert "nvidia" in runtime["containerd"]["runtimes"]


def test_a_node_on_a_version_2_config_keeps_its_settings_under_containerd_2(tmp_path: Path) -> None:
    """Nodes upgraded to containerd 2.x often keep their schema-2 config.toml: 2.x migrates each file."""
    _require_mount_namespaces()
    containerd = _containerd_v2()
    root = tmp_path / "root"
    write_node(root, MAIN_V2)
    run_role(root, 3)
    dump = containerd.dump(root / "etc")
    assert node_settings(dump) == {**EXPECTED[2], "cni_bin": ["/opt/custom/cni/bin"]}
    assert cri_sections(dump)[0]["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == NVIDIA_BINARY


def test_other_imports_of_the_main_config_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_node(root, 'imports = ["/etc/containerd/extra/*.toml"]\n' + MAIN_V2)
    run_role(root, 2)
    main = tomllib.loads((root / "etc/containerd/config.toml").read_text())
    assert main["imports"] == ["/etc/containerd/extra/*.toml", "/etc/containerd/conf.d/*.toml"]


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_node(root, MAIN_V2)
    run_role(root, 2)
    output = run_role(root, 2)
    assert "changed=0" in output.split("PLAY RECAP")[-1], output[-3000:]


def test_a_schema_1_main_config_is_refused_naming_the_file_and_the_fix(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_node(root, '[plugins.cri]\n  sandbox_image = "registry.example.com/pause:3.9"\n')
    run = run_tool([str(BIN / "ansible-playbook"), "-i", "localhost,", str(PLAYBOOK), "-e",
                    json.dumps({"qgpu_root_prefix": str(root), "nvidia_container_toolkit_containerd_config_version": 2})])
    assert run.returncode != 0
    assert "localhost: /etc/containerd/config.toml has version = 1" in run.output
    assert "containerd config migrate" in run.output


# --- the pure part -------------------------------------------------------------------------------

def test_the_toml_writer_round_trips_a_containerd_2_dump(containerd: Containerd, tmp_path: Path) -> None:
    """Every shape a real effective config holds (arrays of tables, empty tables, quoted keys)."""
    (tmp_path / "etc/containerd").mkdir(parents=True)
    (tmp_path / "etc/containerd/config.toml").write_text(MAIN_V2 if containerd.schema == 2 else MAIN_V3)
    dump = containerd.dump(tmp_path / "etc")
    assert tomllib.loads(containerd_config.to_toml(dump)) == dump


def test_schema_3_dropin_holds_only_the_nvidia_runtime() -> None:
    dropin = containerd_config.containerd_nvidia_dropin(tomllib.loads(MAIN_V3), 3, NVIDIA_BINARY, True, True)
    assert dropin == {"version": 3, "plugins": {"io.containerd.cri.v1.runtime": {"containerd": {
        "default_runtime_name": "nvidia",
        "runtimes": {"nvidia": {"runtime_type": "io.containerd.runc.v2", "privileged_without_host_devices": False,
                                "options": {"BinaryName": NVIDIA_BINARY, "SystemdCgroup": True}}}}}}}


def test_a_containerd_2_main_config_is_refused_under_schema_2() -> None:
    with pytest.raises(AnsibleFilterError, match="node-1: /etc/containerd/config.toml has version = 3 but nvidia_container_"):
        containerd_config.containerd_nvidia_dropin({"version": 3}, 2, NVIDIA_BINARY, True, True,
                                                   "/etc/containerd/config.toml", "node-1")
