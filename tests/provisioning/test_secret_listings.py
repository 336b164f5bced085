"""Every role task that lists Secrets, and every task that loops over such a listing, hides its
result (``no_log``): a Secret's listing carries its data, a private key among it, and ``-v`` prints
results (the retire tasks listed the earlier release's TLS Secrets with their keys)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.provisioning.test_webhook_key_secrecy import flatten

ROLES = Path(__file__).resolve().parents[2] / "roles"


def _module(task: dict) -> str:
    return next((k for k in task if "." in k), "")


def _lists_secrets(task: dict) -> bool:
    if _module(task) != "kubernetes.core.k8s_info":
        return False
    args = task.get(_module(task)) or {}
    kinds = [str(args.get("kind", ""))] + [str(i.get("kind", "")) for i in task.get("loop") or [] if isinstance(i, dict)]
    return "Secret" in kinds or "{{ item.kind }}" in kinds and any(
        isinstance(i, dict) and i.get("kind") == "Secret" for i in task.get("loop") or [])


def test_every_secret_listing_and_its_consumers_hide_their_results() -> None:
    found = []
    for path in sorted(ROLES.glob("*/tasks/*.yml")):
        tasks = flatten(yaml.safe_load(path.read_text()) or [])
        listings = {t["register"]: t for t in tasks if _lists_secrets(t) and "register" in t}
        for name, task in listings.items():
            found.append(f"{path.parent.parent.name}: {task['name']}")
            assert task.get("no_log") is True, f"{path}: {task['name']!r} lists Secrets: needs no_log: true"
            for other in tasks:
                if other is not task and "loop" in other and re.search(re.escape(name) + r"\b", str(other.get("loop"))):
                    assert other.get("no_log") is True, (
                        f"{path}: {other['name']!r} loops over {name} (Secrets with their data): needs no_log: true")
    assert len(found) >= 2, found  # the two retire listings at least
