"""The fast tier cannot silently rot (docs/testing.md#the-tiers): a test that starts a control
plane, the real node's components or Ansible while classified fast fails with the marker it needs,
and the tests that do need them are deselected by ``--fast``. Each check runs pytest in a child
process: the guard's audit hook cannot be removed once installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.tiers import ANSIBLE, CONTROLPLANE, REALNODE, command_tier

ROOT = Path(__file__).resolve().parents[1]

# Misclassified on purpose: nothing here requests `cluster`, holds an Ansible runner in its module
# or lives in tests/realnode, so the first four are collected into the fast tier; the fifth is
# marked by hand and deselected.
PLANTED = '''
import subprocess
from pathlib import Path

import pytest

from tests.k8s.controlplane import ControlPlane


def test_starts_a_control_plane(tmp_path):
    ControlPlane(Path("/nonexistent"), tmp_path).start()


def test_runs_ansible():
    from tests.provisioning import ansible_tools  # imported here, out of the module's sight

    ansible_tools.run_tool(["ansible-playbook", "--version"])


def test_runs_a_kubelet_behind_setpriv():
    subprocess.run(["setpriv", "--pdeathsig", "KILL", "/nonexistent/kubelet", "--version"])


def test_runs_an_ordinary_program():
    subprocess.run(["true"], check=True)


@pytest.mark.controlplane
def test_marked_by_hand():
    ControlPlane(Path("/nonexistent"), Path("/nonexistent")).start()
'''


def pytest_in_child(*args: str, outside_tests: bool = False) -> subprocess.CompletedProcess[str]:
    """pytest with this checkout's settings; for files ``outside_tests``, tests/conftest.py is
    loaded as a plugin so they get the tiers too (under tests/ it is found as the conftest)."""
    plugin = ["-p", "tests.conftest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT)] if outside_tests else []
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *plugin, *args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)


def test_the_guard_fails_a_misclassified_test_naming_the_marker_it_needs(tmp_path: Path) -> None:
    planted = tmp_path / "test_planted.py"
    planted.write_text(textwrap.dedent(PLANTED))
    run = pytest_in_child("--fast", "-q", str(planted), outside_tests=True)
    assert run.returncode == 1, run.stdout
    assert "3 failed, 1 passed, 1 deselected" in run.stdout, run.stdout
    for test, marker in [("test_starts_a_control_plane", CONTROLPLANE), ("test_runs_ansible", ANSIBLE),
                         ("test_runs_a_kubelet_behind_setpriv", REALNODE)]:
        failure = run.stdout.split(f"___ {test} ___", 1)[1].split("\n____", 1)[0]
        assert "TierError: this test" in failure and f"it needs the {marker} tier. Mark it @pytest.mark.{marker}" in failure, failure[:3000]


TIER_FILES = ["tests/k8s/test_e2e_webhook.py", "tests/realnode/test_e2e_deploy.py", "tests/provisioning/test_webhook_dra_live.py",
              "tests/provisioning/test_molecule.py", "tests/provisioning/test_scheduler_wiring.py"]


def collected_files(*args: str) -> set[str]:
    run = pytest_in_child("--collect-only", "-q", *args, *TIER_FILES)
    assert run.returncode == 0, run.stdout
    return {line.split("::")[0] for line in run.stdout.splitlines() if "::" in line}


def test_fast_deselects_what_needs_a_control_plane_the_real_node_or_ansible() -> None:
    assert collected_files("--fast") == {"tests/provisioning/test_scheduler_wiring.py"}


def test_without_fast_every_tier_is_collected() -> None:
    """The README's command passes no -m and no --fast: the markers deselect nothing there, so it
    can never end with pytest's exit 5 (no tests collected)."""
    assert collected_files() == set(TIER_FILES)


@pytest.mark.parametrize("argv, tier", [
    (["/x/.cache/k8s-testbin/v1.37.2/bin/kube-apiserver", "--etcd-servers=x"], CONTROLPLANE),
    (["/x/bin/etcd"], CONTROLPLANE),
    (["setpriv", "--pdeathsig", "KILL", "/x/kubelet"], REALNODE),
    ("containerd", REALNODE),
    ([".venv/bin/molecule", "test"], ANSIBLE),
    ([".venv/bin/ansible-playbook", "site.yml"], ANSIBLE),
    (["git", "grep", "molecule"], None),
    ([sys.executable, "-m", "pytest"], None),
    (["setpriv", "--pdeathsig", "KILL", ".venv/bin/qgpu", "manager", "serve"], None),
])
def test_command_tier(argv: list[str] | str, tier: str | None) -> None:
    assert command_tier(argv) == tier
