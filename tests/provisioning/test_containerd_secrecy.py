"""Credentials in a node's containerd config never reach Ansible's output, and the roles' drop-ins
are no more readable than the file they copy from.

containerd's CRI plugin takes registry credentials in its main config (`registry.configs.<host>.auth`:
username, password, auth, identitytoken). nvidia_container_toolkit and qgpu_node_pool read that
file to edit its `imports` line, and on containerd 1.x (schema 2) the nvidia drop-in repeats the
whole CRI table. With `-v` Ansible prints every task's result (a slurp's base64 text, a set_fact's
values) and with `--diff` every written file's change: both runs are searched here for the secret,
as it is and base64-encoded. Beside them, the task that applies a service-account token Secret is
read: kubernetes.core.k8s returns the applied object, its token with it.
"""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import yaml
from ansible_tools import BIN, REPO, run_tool
from test_webhook_key_secrecy import flatten

SECRET = "s3cr3t-Registry-Passw0rd"
MAIN_V2 = f"""\
version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.example.com/pause:3.9"
[plugins."io.containerd.grpc.v1.cri".registry.configs."registry.example.com".auth]
  username = "robot"
  password = "{SECRET}"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
"""
# the credentials next to the `imports` line the roles edit: a diff's context lines would show them
MAIN_V3 = f"""\
version = 3
imports = ["/etc/containerd/other.d/*.toml"]
[plugins."io.containerd.cri.v1.images".registry.configs."registry.example.com".auth]
  password = "{SECRET}"
  username = "robot"
"""


def betrayed(output: str) -> list[str]:
    """The forms in which the secret shows in ``output``: plain, or inside the base64 of a text
    that holds it (three alignments, as it may sit anywhere in the file)."""
    found = [SECRET] if SECRET in output else []
    for shift in range(3):
        encoded = base64.b64encode(b"x" * shift + SECRET.encode()).decode()
        middle = encoded[4:-4]  # the part that does not depend on the neighbouring bytes
        if middle in output:
            found.append(middle)
    return found


def sandbox(root: Path, main: str, mode: int) -> Path:
    """A GPU node (one T4 on the fixture PCI bus) whose containerd config holds a registry password."""
    pci = Path(f"{root}-probe/sys/bus/pci/devices/0000:3b:00.0")
    pci.mkdir(parents=True)
    for name, value in {"vendor": "0x10de", "class": "0x030200", "device": "0x1eb8"}.items():
        (pci / name).write_text(value + "\n")
    (root / "etc/containerd").mkdir(parents=True)
    config = root / "etc/containerd/config.toml"
    config.write_text(main)
    config.chmod(mode)
    return config


def play(playbook: str, **extra: object) -> str:
    run = run_tool([str(BIN / "ansible-playbook"), "-i", "localhost,", "-v", "--diff",
                    str(REPO / "tests/provisioning/playbooks" / playbook), "-e", json.dumps(extra)])
    assert run.returncode == 0, run.output[-5000:]
    return run.output


def test_the_toolkit_role_prints_no_registry_password_and_keeps_the_dropin_private(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sandbox(root, MAIN_V2, 0o600)
    outputs = [play("nvidia-containerd.yml", qgpu_root_prefix=str(root), nvidia_container_toolkit_containerd_config_version=2)
               for _ in range(2)]  # the first run writes the drop-in (a diff), the second finds it
    dropin = root / "etc/containerd/conf.d/99-nvidia.toml"
    assert SECRET in dropin.read_text()  # schema 2: the drop-in repeats the CRI table, credentials too
    assert stat.S_IMODE(dropin.stat().st_mode) == 0o600  # as private as the main config it copies
    assert "TASK [nvidia_container_toolkit : Write the nvidia runtime drop-in]" in outputs[0]
    for output in outputs:
        assert betrayed(output) == [], "the registry password is in ansible-playbook's output"


def test_the_toolkit_role_keeps_a_world_readable_main_configs_dropin_as_it_was(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sandbox(root, MAIN_V3, 0o644)
    output = play("nvidia-containerd.yml", qgpu_root_prefix=str(root), nvidia_container_toolkit_containerd_config_version=3)
    assert betrayed(output) == []
    dropin = root / "etc/containerd/conf.d/99-nvidia.toml"
    assert SECRET not in dropin.read_text()  # schema 3: only the nvidia runtime
    assert stat.S_IMODE(dropin.stat().st_mode) == 0o644


def test_a_parse_error_still_names_the_file(tmp_path: Path) -> None:
    """The text is kept out of the output, not the reason the role stops on it."""
    root = tmp_path / "root"
    sandbox(root, MAIN_V2 + "[broken\n", 0o600)
    run = run_tool([str(BIN / "ansible-playbook"), "-i", "localhost,", "-v",
                    str(REPO / "tests/provisioning/playbooks/nvidia-containerd.yml"),
                    "-e", json.dumps({"qgpu_root_prefix": str(root), "nvidia_container_toolkit_containerd_config_version": 2})])
    assert run.returncode != 0
    assert "/etc/containerd/config.toml is not valid TOML" in run.output, run.output[-3000:]
    assert betrayed(run.output) == []


def test_the_node_pool_role_prints_no_registry_password(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sandbox(root, MAIN_V3, 0o600)
    output = play("node-pool-cdi.yml", qgpu_root_prefix=str(root), qgpu_pool_mode="dra",
                  qgpu_node_pool_containerd_version="2.4.2")
    assert "Read the main containerd config" in output
    assert betrayed(output) == [], "the registry password is in ansible-playbook's output"


def test_every_task_applying_a_secret_hides_its_result() -> None:
    """kubernetes.core.k8s returns the object the apiserver answered with: a Secret's data (the
    re-wiring watcher's token, filled in by kube-controller-manager, printed at -v on every re-run
    until this was split into a no_log task of its own)."""
    applying = []
    for path in sorted((REPO / "roles").glob("*/tasks/*.yml")):
        for task in flatten(yaml.safe_load(path.read_text()) or []):
            args = task.get("kubernetes.core.k8s")
            if not isinstance(args, dict):
                continue
            definition = args.get("definition")
            docs = definition if isinstance(definition, list) else [definition]
            if any(isinstance(d, dict) and d.get("kind") == "Secret" for d in docs):
                applying.append((path.relative_to(REPO), task))
    assert any("re-wiring watcher's token" in t["name"] for _, t in applying), [t["name"] for _, t in applying]
    for path, task in applying:
        assert task.get("no_log") is True, f"{path}: {task['name']!r} applies a Secret: needs no_log: true"
