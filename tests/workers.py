"""How the full run shares its tests among pytest-xdist workers (docs/testing.md#workers).

A worker takes a whole *group* at a time, never one test of it: a module (its module-scoped
fixtures are set up once), every real-node test (the host has room for one kubelet, containerd and
``/var/lib/kubelet`` at a time, and the package's cluster is shared by all of them) and every test
of the EL8 host (one nspawn machine of that name). ``GroupScheduling`` is xdist's ``loadscope``
with this grouping; tests/conftest.py installs it for every mode that shares tests out and puts
the longest kinds of groups first in every worker's collection, which is the queue's order.

(pytest-xdist's own ``loadgroup`` would do the grouping from an ``xdist_group`` mark, but 3.8.0
renames the test's ``_nodeid``, which pytest 9 no longer reads: every test ends up a group of its
own.)
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadScopeScheduling

# Directories whose tests form one group each: nodeid prefix -> group name.
WHOLE_DIRECTORIES = {"tests/realnode/": "realnode", "tests/elhost/": "elhost"}


def group(nodeid: str) -> str:
    """The group of a test, from its nodeid (relative to the rootdir, as xdist's scheduler sees it)."""
    for prefix, name in WHOLE_DIRECTORIES.items():
        if nodeid.startswith(prefix):
            return name
    return nodeid.split("::", 1)[0]


class GroupScheduling(LoadScopeScheduling):
    """xdist's ``loadscope`` whose scope is ``group``, its queue in the order of the collection
    (tests/conftest.py sorts it), never by the number of tests in a group."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return group(nodeid)
