"""Docs name only role variables the roles really read (issue 22 §6): every ``<role>_<name>``
written in docs/*.md or a role's README is defined or read by some role (defaults, vars, tasks,
argument specs, templates) or a playbook. A renamed or invented variable in the docs sends an
operator to set something nothing reads."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROLES = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "defaults").is_dir() or (p / "tasks").is_dir())
# Variable-looking names that are not role variables: metric names and facts the docs quote.
NOT_VARIABLES = re.compile(r"^qgpu_(allocate|card|container|isolation|memory|untrusted)_|^qgpu_webhook_serving_certificate")


def _read(paths: list[Path]) -> str:
    return "\n".join(p.read_text(errors="replace") for p in paths if p.is_file())


def _sources() -> str:
    files: list[Path] = []
    for role in ROLES:
        for sub in ("defaults", "vars", "tasks", "meta", "handlers", "templates", "filter_plugins", "molecule"):
            files += list((REPO / "roles" / role / sub).rglob("*"))
    files += list((REPO / "templates").rglob("*")) + list((REPO / "playbooks").rglob("*.yml"))
    return _read(files)


def test_every_role_variable_the_docs_name_is_read_by_a_role():
    pattern = re.compile(r"\b((?:" + "|".join(map(re.escape, ROLES)) + r")_[a-z0-9_]*[a-z0-9])\b")
    sources = _sources()
    named: dict[str, set[str]] = {}
    for doc in sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "roles").glob("*/README.md")):
        for name in pattern.findall(doc.read_text()):
            if not NOT_VARIABLES.match(name):
                named.setdefault(name, set()).add(str(doc.relative_to(REPO)))
    unread = {name: sorted(docs) for name, docs in named.items() if not re.search(r"\b" + re.escape(name) + r"\b", sources)}
    assert unread == {}, f"docs name role variables no role reads: {unread}"
