"""Structure mutations of a valid JSON document, for fuzzing decoders: one value anywhere in the
tree replaced by a value of another JSON type (null included), or one key dropped."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

Path = tuple[Any, ...]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**20) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def paths(doc: Any, prefix: Path = ()) -> list[Path]:
    """Every path to a value inside ``doc`` (the root excluded)."""
    found: list[Path] = []
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in children:
        found.append(prefix + (key,))
        found.extend(paths(value, prefix + (key,)))
    return found


def mutated(doc: Any, path: Path, replacement: Any, drop: bool) -> Any:
    """A copy of ``doc`` with the value at ``path`` replaced (or its key dropped)."""
    doc = copy.deepcopy(doc)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if drop and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return doc


def mutations(doc: Any) -> st.SearchStrategy[Any]:
    """Documents one structural change away from ``doc``."""
    return st.builds(mutated, st.just(doc), st.sampled_from(paths(doc)), json_values, st.booleans())
