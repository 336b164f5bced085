"""The full run's workers (tests/workers.py, docs/testing.md#workers): a group runs whole on one
worker, the real node's first; checked on planted tests run by a child pytest on two workers with
this project's own hooks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers import group

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = """
from tests.conftest import (pytest_addoption, pytest_collection_modifyitems, pytest_configure, pytest_runtest_setup,  # noqa: F401
                            pytest_xdist_make_scheduler)
"""

INI = """[pytest]
markers =
    realnode: planted
    controlplane: planted
    ansible: planted
    slow: planted
"""

RECORDING_TEST = """
import os
import time
from pathlib import Path

import pytest

{mark}


@pytest.mark.parametrize("n", range(3))
def test_records_its_worker(n, request):
    time.sleep(0.05)
    out = Path({out!r})
    out.mkdir(exist_ok=True)
    (out / f"{{time.time_ns()}}-{{os.getpid()}}").write_text(os.environ["PYTEST_XDIST_WORKER"] + " " + request.node.nodeid)
"""


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    tree = tmp_path / "tree"
    for name, mark in files.items():
        path = tree / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(RECORDING_TEST.format(mark=mark, out=str(tmp_path / "ran")))
    (tree / "conftest.py").write_text(CONFTEST)
    (tree / "pytest.ini").write_text(INI)
    return tree


def run_on_two_workers(tree: Path, *dist: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", *(dist or ("--dist", "loadscope")), "-q"],
                          cwd=tree, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, timeout=300)


def test_group_names_a_whole_directory_or_else_the_module() -> None:
    assert group("tests/realnode/test_e2e_dra.py::test_x[a::b]") == "realnode"
    assert group("tests/elhost/test_repo.py::test_y") == "elhost"
    assert group("tests/k8s/test_e2e_groups.py::test_z[p]") == "tests/k8s/test_e2e_groups.py"
    assert group("tests/test_layers.py::test_a_forbidden_import_fails_the_contracts[x::y]") == "tests/test_layers.py"
    assert group("tests/realnodes/test_x.py::t") == "tests/realnodes/test_x.py"


@pytest.mark.parametrize("dist", [(), ("--dist", "load"), ("--dist", "loadfile")], ids=["test.sh", "load", "loadfile"])
def test_each_group_runs_whole_on_one_worker_the_real_node_first(tmp_path: Path, dist: tuple[str, ...]) -> None:
    realnode = "pytestmark = pytest.mark.realnode"
    # Without the ranking, each worker would start on one of tests/aaa and tests/bbb, collected
    # before tests/realnode.
    tree = plant(tmp_path, {"tests/aaa/test_plain.py": "", "tests/bbb/test_plain_b.py": "", "tests/realnode/test_one.py": realnode,
                            "tests/realnode/test_two.py": realnode, "tests/zzz/test_plain_too.py": "",
                            "tests/zzz/test_other.py": ""})
    done = run_on_two_workers(tree, *dist)
    assert done.returncode == 0, done.stdout
    assert "18 passed" in done.stdout, done.stdout
    ran = [(path.read_text().split(" ", 1)) for path in sorted((tmp_path / "ran").iterdir(), key=lambda p: int(p.name.split("-")[0]))]
    workers_of: dict[str, set[str]] = {}
    for worker, nodeid in ran:
        workers_of.setdefault(group(nodeid), set()).add(worker)
    assert set(workers_of) == {"realnode", "tests/aaa/test_plain.py", "tests/bbb/test_plain_b.py", "tests/zzz/test_plain_too.py",
                               "tests/zzz/test_other.py"}
    assert all(len(ws) == 1 for ws in workers_of.values()), workers_of
    assert len({w for ws in workers_of.values() for w in ws}) == 2, "both workers got work"
    (realnode_worker,) = workers_of["realnode"]
    on_it = [group(nodeid) for worker, nodeid in ran if worker == realnode_worker]
    assert on_it[:6] == ["realnode"] * 6, on_it


@pytest.mark.parametrize("where", ["tests/aaa/test_needs_the_node.py", "tests/realnode_extra/test_x.py"])
def test_a_real_node_test_outside_tests_realnode_is_refused(tmp_path: Path, where: str) -> None:
    tree = plant(tmp_path, {where: "pytestmark = pytest.mark.realnode", "tests/realnode/test_one.py": "pytestmark = pytest.mark.realnode"})
    done = run_on_two_workers(tree)
    assert done.returncode == 1
    assert "3 passed, 3 errors" in done.stdout, done.stdout
    for n in range(3):
        assert f"{where}::test_records_its_worker[{n}] needs the real node but lives outside tests/realnode" in done.stdout, done.stdout
    ran = [path.read_text() for path in (tmp_path / "ran").iterdir()]
    assert len(ran) == 3 and all("tests/realnode/test_one.py" in line for line in ran), "the misplaced tests ran nothing"
