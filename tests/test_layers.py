"""The layers of docs/architecture.md are enforced by import-linter (contracts in pyproject.toml),
which the README's test command runs before pytest. These tests show the contracts bite: a copy of
the package with one forbidden import added fails them, naming the import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", str(tree / "pyproject.toml")], cwd=tree,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "qgpu_runtime", tmp_path / "qgpu_runtime", ignore=shutil.ignore_patterns("__pycache__", "_generated"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _add_import(tree: Path, module: str, line: str) -> None:
    path = tree / (module.replace(".", "/") + ".py")
    path.write_text((path.read_text() if path.exists() else '"""A new module."""\n') + f"\n{line}\n")


def test_the_package_keeps_its_layers(tree: Path):
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("module, line, broken", [
    ("qgpu_runtime.standalone.manager_cmd", "from qgpu_runtime.node import cli  # noqa", "qgpu_runtime.standalone is not allowed to import qgpu_runtime.node"),
    ("qgpu_runtime.extender.cache", "import qgpu_runtime.webhook.admission  # noqa", "qgpu_runtime.extender is not allowed to import qgpu_runtime.webhook"),
    ("qgpu_runtime.contract.record", "import qgpu_runtime.placement.state  # noqa", "qgpu_runtime.contract is not allowed to import qgpu_runtime.placement"),
    ("qgpu_runtime.kube.client", "import qgpu_runtime.node.metrics  # noqa", "qgpu_runtime.kube is not allowed to import qgpu_runtime.node"),
    ("qgpu_runtime.placement.engine", "import sqlite3  # noqa", "qgpu_runtime.placement is not allowed to import sqlite3"),
    ("qgpu_runtime.isolation.control", "import pynvml  # noqa", "qgpu_runtime.isolation is not allowed to import pynvml"),
    ("qgpu_runtime.isolation.control", "import qgpu_runtime.isolation.engine  # noqa", "No cycles are allowed in qgpu_runtime.isolation"),
    ("qgpu_runtime.node.deviceplugin.plugin", "import qgpu_runtime.node.manager  # noqa", "No cycles are allowed in qgpu_runtime.node"),
    ("qgpu_runtime.status_cmd", "from qgpu_runtime.node import pods  # noqa", "qgpu_runtime.status_cmd -> qgpu_runtime.node.pods"),
    ("qgpu_runtime.newtool", "from qgpu_runtime.node import store  # noqa", "qgpu_runtime.newtool -> qgpu_runtime.node.store"),
    ("qgpu_runtime.extender.cache", "import kubernetes  # noqa", "qgpu_runtime.extender.cache -> kubernetes"),
    ("qgpu_runtime.webhook.admission", "from kubernetes import client  # noqa", "qgpu_runtime.webhook.admission -> kubernetes"),
    ("qgpu_runtime.node.dra.plugin", "from qgpu_runtime.node.deviceplugin import resources  # noqa", "qgpu_runtime.node.dra is not allowed to import qgpu_runtime.node.deviceplugin"),
    ("qgpu_runtime.node.deviceplugin.response", "from qgpu_runtime.node.dra import cdi  # noqa", "qgpu_runtime.node.deviceplugin is not allowed to import qgpu_runtime.node.dra"),
    ("qgpu_runtime.isolation.memory", "import sqlite3  # noqa", "qgpu_runtime.isolation.memory is not allowed to import sqlite3"),
    ("qgpu_runtime.isolation.engine", "import kubernetes  # noqa", "qgpu_runtime.isolation.engine is not allowed to import kubernetes"),
    ("qgpu_runtime.isolation.control", "import grpc  # noqa", "qgpu_runtime.isolation.control is not allowed to import grpc"),
])
def test_a_forbidden_import_fails_the_contracts(tree: Path, module: str, line: str, broken: str):
    _add_import(tree, module, line)
    result = _lint(tree)
    assert result.returncode != 0
    assert broken in " ".join(result.stdout.split()), result.stdout
