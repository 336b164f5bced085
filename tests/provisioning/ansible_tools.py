"""Helpers for the provisioning tests: where the checkout and its Ansible tools are, and how to
run ansible-playbook / molecule against localhost. (A plain module, not a conftest, so its name
cannot collide with other test folders' conftest modules.)"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.tiers import ANSIBLE, refuse_in_fast_tier

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ROLES = sorted(p.parent.parent.parent.name for p in (REPO / "roles").glob("*/molecule/default/molecule.yml"))


@dataclass(frozen=True)
class Run:
    """A finished ansible-playbook or molecule run."""

    returncode: int
    output: str

    def recap_changed(self) -> int:
        """Sum of changed=N over the PLAY RECAP lines."""
        total = 0
        for line in self.output.splitlines():
            if " changed=" in line and "ok=" in line:
                total += int(line.split(" changed=")[1].split()[0])
        return total


def tool_env(**extra: str) -> dict[str, str]:
    """Environment for Ansible tools: this venv first on PATH, no colours. Playbooks run from the
    repository root, so its ansible.cfg applies; molecule writes its own."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["ANSIBLE_NOCOLOR"] = "1"
    env["NO_COLOR"] = "1"
    env.update(extra)
    return env


def run_tool(argv: list[str], cwd: Path = REPO, timeout: int = 600, **env: str) -> Run:
    refuse_in_fast_tier(f"runs {Path(argv[0]).name}", ANSIBLE)
    proc = subprocess.run(argv, cwd=cwd, env=tool_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, check=False)
    return Run(proc.returncode, proc.stdout)


def ansible_playbook(*args: str, timeout: int = 600) -> Run:
    return run_tool([str(BIN / "ansible-playbook"), *args], timeout=timeout)


def expected_pool_labels(group_vars: dict[str, Any]) -> dict[str, str | None]:
    """What the pool's group vars ask for; None: the label must be absent."""
    return {
        "qgpu-device-enable": "enable",
        "tke.cloud.tencent.com/qgpu-schedule-policy": group_vars["qgpu_node_pool_isolation_policy"],
        "mixed-qgpu-enable": "enable" if group_vars.get("qgpu_node_pool_mixed") else None,
        "sched.tensorstack.dev/accelerator": group_vars.get("qgpu_node_pool_accelerator") or None,
        "sched.tensorstack.dev/node-alloc-mode": group_vars.get("qgpu_node_pool_alloc_mode", "sgn") or None,
        "qgpu.io/pool-mode": group_vars.get("qgpu_pool_mode", "device-plugin"),
    }
