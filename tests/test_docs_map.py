"""docs/architecture.md is the map: it links every document, and every relative link in the docs
(and the README) reaches an existing file and, where it names one, an existing heading."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", path.read_text(), re.M)}


def test_the_map_links_every_document():
    text = (ROOT / "docs/architecture.md").read_text()
    linked = {Path(target.split("#")[0]).name for target in LINK.findall(text)}
    assert {p.name for p in DOCS} - {"architecture.md"} <= linked


def test_every_relative_link_reaches_its_file_and_heading():
    broken = []
    for doc in [*DOCS, ROOT / "README.md"]:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_slug_matches_githubs_for_code_and_punctuation():
    assert _slug("The control law (`isolation/control.py`, pure)") == "the-control-law-isolationcontrolpy-pure"
    assert _slug("Store schema (also the read interface of `qgpu status --standalone-db`)") == \
        "store-schema-also-the-read-interface-of-qgpu-status---standalone-db"
