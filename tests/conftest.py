"""The test tiers, marked from what each test uses (docs/testing.md#the-tiers).

Markers are applied here rather than by hand so they cannot rot: a test is

- ``realnode`` when it lives in ``tests/realnode`` or requests one of its clusters,
- ``controlplane`` when it requests the ``cluster`` fixture (directly or through other fixtures:
  ``item.fixturenames`` is the whole closure),
- ``ansible`` when its module calls ``ansible_tools.run_tool``/``ansible_playbook``, itself or
  through a helper imported from another test module,

and ``slow`` when any of these applies (``slow`` may also be set by hand on a test that needs none
of them and is still too slow to iterate with). ``pytest --fast`` (``scripts/test.sh --fast``)
deselects every ``slow`` test and installs the guard of ``tests/tiers.py``, which fails a test that
starts a control plane, a kubelet/containerd or Ansible anyway: a rule here that misses a new way
of starting one shows up as a failure, never as a quietly slow fast tier.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import tiers, workers

CONTROLPLANE_FIXTURES = {"cluster"}  # tests/k8s/conftest.py, re-exported by tests/provisioning/conftest.py
REALNODE_DIR = Path(__file__).resolve().parent / "realnode"
REALNODE_FIXTURES = {"local_cluster", "dra_cluster"}  # tests/realnode/conftest.py and test_e2e_dra.py
MISPLACED = pytest.StashKey[str]()  # a real-node test outside tests/realnode: why it cannot run
ANSIBLE_RUNNERS = {"run_tool", "ansible_playbook"}  # tests/provisioning/ansible_tools.py


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", default=False,
                     help="run the fast tier only: deselect tests marked slow (control plane, real node, Ansible) "
                          "and fail any test that starts one of them anyway (docs/testing.md#the-tiers)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("fast"):
        tiers.install_guard()


def pytest_report_header(config: pytest.Config) -> str:
    return "tier: fast (slow tests deselected, guard on)" if config.getoption("fast") else "tier: all"


def _is_runner(obj: Any) -> bool:
    """A runner of ansible_tools, imported as ``ansible_tools`` (tests/provisioning) or by its full name."""
    return inspect.isfunction(obj) and obj.__module__.rpartition(".")[2] == "ansible_tools" and obj.__name__ in ANSIBLE_RUNNERS


_ansible_modules: dict[str, bool] = {}


def _runs_ansible(module: ModuleType) -> bool:
    """The module holds an Ansible runner, or a function imported from another test module that
    holds one (test_webhook_dra_live's ``render`` from test_webhook_dra_render)."""
    if module.__name__ not in _ansible_modules:
        namespaces = [vars(module)] + [obj.__globals__ for obj in vars(module).values()
                                       if inspect.isfunction(obj) and obj.__module__ != module.__name__ and not _is_runner(obj)]
        _ansible_modules[module.__name__] = any(_is_runner(obj) for names in namespaces for obj in names.values())
    return _ansible_modules[module.__name__]


def tier_markers(item: pytest.Item) -> list[str]:
    """The slow tiers ``item`` needs, from its directory, its fixtures and its module."""
    found = []
    fixtures = set(getattr(item, "fixturenames", ()))
    if item.path.resolve().is_relative_to(REALNODE_DIR) or fixtures & REALNODE_FIXTURES:
        found.append(tiers.REALNODE)
    if fixtures & CONTROLPLANE_FIXTURES:
        found.append(tiers.CONTROLPLANE)
    module = getattr(item, "module", None)
    if module is not None and _runs_ansible(module):
        found.append(tiers.ANSIBLE)
    return found


def _rank(item: pytest.Item, group: str) -> int:
    """Where a test's group goes in the workers' queue: the longest kinds first (the real node, the
    EL8 host, playbooks against a control plane, playbooks, the control plane), so that no long
    group starts last while the other workers have run out of work."""
    if group == tiers.REALNODE:
        return 0
    if group == "elhost":
        return 1
    ansible = item.get_closest_marker(tiers.ANSIBLE) is not None
    controlplane = item.get_closest_marker(tiers.CONTROLPLANE) is not None
    return 2 if ansible and controlplane else 3 if ansible else 4 if controlplane else 5


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name in tier_markers(item):
            item.add_marker(name)
        # A tier marker set by hand counts as much as one found here.
        needs = [name for name in (tiers.CONTROLPLANE, tiers.REALNODE, tiers.ANSIBLE) if item.get_closest_marker(name)]
        if needs and item.get_closest_marker("slow") is None:
            item.add_marker("slow")
    if config.getoption("fast"):
        deselected = [item for item in items if item.get_closest_marker("slow") is not None]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    item_groups = [workers.group(item.nodeid) for item in items]
    groups: dict[str, tuple[int, int]] = {}  # group -> (rank, position of its first test)
    for item, group in zip(items, item_groups):
        if item.get_closest_marker(tiers.REALNODE) is not None and group != tiers.REALNODE:
            item.stash[MISPLACED] = (f"{item.nodeid} needs the real node but lives outside tests/realnode: a test worker would "
                                     "then bring up a second real-node cluster beside the one of tests/realnode (tests/workers.py); "
                                     "move it there")
        rank = _rank(item, group)
        known, first = groups.get(group, (rank, len(groups)))
        groups[group] = (min(rank, known), first)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Every worker sorts its collection alike (xdist checks that they are equal): the queue of
        # groups in this order, a group's tests together and in their order.
        items[:] = [item for _, item in sorted(zip(item_groups, items), key=lambda pair: groups[pair[0]])]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A misplaced real-node test fails here, before its fixtures start anything (an error raised
    while collecting would be lost in a worker's crash)."""
    if MISPLACED in item.stash:
        pytest.fail(item.stash[MISPLACED], pytrace=False)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """qgpu's groups as the scopes of ``--dist loadscope`` (scripts/test.sh), and of every other
    mode that shares tests out (a plain ``-n 3`` is ``--dist load``): split, the real-node tests
    would bring up a cluster on each worker at once. ``--dist each`` (every test on every worker)
    stays as xdist has it."""
    if config.getvalue("dist") == "each":
        return None
    return workers.GroupScheduling(config, log)
