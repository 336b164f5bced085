"""The test tiers (docs/testing.md#the-tiers) and the guard that keeps the fast tier honest.

A test belongs to a slow tier when it needs a real control plane (``controlplane``), the real
node (``realnode``) or an Ansible run (``ansible``); ``tests/conftest.py`` marks it from what it
uses. ``scripts/test.sh --fast`` (``pytest --fast``) runs the rest with ``QGPU_TEST_TIER=fast`` set
and the audit hook below installed, so a test that starts one of these anyway fails with the
marker it needs instead of quietly making the fast tier slow (or root-only). The helpers that start
them (``ControlPlane.start``, ``ansible_tools.run_tool``) call ``refuse_in_fast_tier`` themselves:
the environment variable reaches child processes, where the audit hook does not.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

TIER_ENV = "QGPU_TEST_TIER"
FAST = "fast"

# The three markers of the slow tiers; `slow` is added to every test that carries one of them.
CONTROLPLANE, REALNODE, ANSIBLE = "controlplane", "realnode", "ansible"

# What each slow tier starts, by executable name. The real node's components come first: a
# kube-scheduler run by the real node is still the real node.
COMMANDS = {
    "etcd": CONTROLPLANE, "kube-apiserver": CONTROLPLANE, "kube-scheduler": CONTROLPLANE,
    "kube-controller-manager": REALNODE, "kubelet": REALNODE, "containerd": REALNODE,
    "ansible": ANSIBLE, "ansible-playbook": ANSIBLE, "ansible-inventory": ANSIBLE, "ansible-lint": ANSIBLE,
    "ansible-galaxy": ANSIBLE, "molecule": ANSIBLE,
}

# Commands that run the command given after them (setpriv --pdeathsig KILL kubelet ...).
WRAPPERS = {"setpriv", "sudo", "env", "timeout", "nsenter", "unshare", "systemd-run"}


class TierError(RuntimeError):
    """A test of the fast tier started what only a slow tier may start."""


def in_fast_tier() -> bool:
    return os.environ.get(TIER_ENV) == FAST


def refuse_in_fast_tier(what: str, marker: str) -> None:
    """Raise when the fast tier is running: ``what`` (e.g. "starts a control plane") needs
    ``marker``. Called where the slow thing starts, so a misclassified test fails at once."""
    if in_fast_tier():
        raise TierError(
            f"this test {what}, but it runs in the fast tier ({TIER_ENV}={FAST}, scripts/test.sh --fast): "
            f"it needs the {marker} tier. Mark it @pytest.mark.{marker}, or teach tests/conftest.py how to "
            f"see it (docs/testing.md#the-tiers)")


def command_tier(argv: Any) -> str | None:
    """The slow tier a command line starts, or None: its program, or behind a wrapper such as
    ``setpriv --pdeathsig KILL`` any word naming one of the programs above."""
    words = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv or [])
    names = [Path(os.fsdecode(word)).name for word in words]
    if not names:
        return None
    if names[0] in WRAPPERS:
        return next((COMMANDS[name] for name in names[1:] if name in COMMANDS), None)
    return COMMANDS.get(names[0])


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "subprocess.Popen":
        return
    executable, argv = args[0], args[1]
    tier = command_tier(argv) or (command_tier(executable) if executable else None)
    if tier is not None:
        words = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv)
        refuse_in_fast_tier(f"runs `{' '.join(map(os.fsdecode, words))[:200]}`", tier)


_installed = False


def install_guard() -> None:
    """Enter the fast tier for this process and its children: the environment variable for
    helpers (here and in child processes), an audit hook for every subprocess started here. An
    audit hook cannot be removed, so this is for a process that runs the fast tier only."""
    global _installed
    os.environ[TIER_ENV] = FAST
    if not _installed:
        sys.addaudithook(_audit)
        _installed = True
