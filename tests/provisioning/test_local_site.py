"""The main job: `ansible-playbook site.yml` from the repository root on inventories/local, run
twice into a temporary root, then teardown.yml: both runs succeed with this checkout's runtime,
the smoke jobs run on their shares, `qgpu status` is printed, and the second run changes nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from ansible_tools import BIN, Run, run_tool


def site(root: Path, playbook: str = "site.yml") -> Run:
    # From the repository root with no -i: ansible.cfg's inventory (inventories/local) applies.
    return run_tool([str(BIN / "ansible-playbook"), playbook, "-e", json.dumps({"qgpu_root_prefix": str(root)})],
                    timeout=900)


@pytest.fixture
def local_root(tmp_path: Path):
    root = tmp_path / "local-root"
    yield root
    # Stops a manager a failed assertion left running, and removes the runtime.
    run_tool([str(BIN / "ansible-playbook"), "playbooks/teardown.yml", "-e", json.dumps({"qgpu_root_prefix": str(root)})])


@pytest.mark.slow
def test_site_on_the_local_inventory_runs_then_changes_nothing(local_root: Path) -> None:
    first = site(local_root)
    assert "SKIPPING the install on localhost" in first.output, "driver/CUDA/toolkit skips must be reported"
    for check in ("python", "os", "kernel_headers", "gpu_models", "driver", "cuda", "nvidia_uvm", "container_tools"):
        assert re.search(rf'"(PASS|FAIL) {check}: ', first.output), f"preflight report lacks {check}"
    recorded = json.loads((local_root / "opt/qgpu/installed.json").read_text())
    assert recorded["wheel"] == f"qgpu_runtime-{recorded['version']}-py3-none-any.whl"

    assert first.returncode == 0, first.output[-6000:]
    for job, share in (("trainer", "'QGPU_CLASS': 'offline', 'QGPU_CORE_MILLI': '500'"),
                       ("inference", "'QGPU_CLASS': 'online', 'QGPU_CORE_MILLI': '0'"),
                       ("notebook", "'QGPU_CLASS': 'normal', 'QGPU_CORE_MILLI': '200'")):
        assert re.search(rf"{job} \(exit 0\): .*{re.escape(share)}", first.output), f"smoke job {job} did not run on its share"
    assert "NODE  POLICY       CARD  MODEL" in first.output, "qgpu status was not printed"

    second = site(local_root)
    assert second.returncode == 0, second.output[-6000:]
    assert second.recap_changed() == 0, second.output[-6000:]

    teardown = run_tool([str(BIN / "ansible-playbook"), "playbooks/teardown.yml",
                         "-e", json.dumps({"qgpu_root_prefix": str(local_root)})])
    assert teardown.returncode == 0, teardown.output[-4000:]
    assert not (local_root / "opt/qgpu").exists()
    assert not (local_root / "var/lib/qgpu/manager.pid").exists()
