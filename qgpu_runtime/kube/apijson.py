"""Decoding the apiserver's JSON when a tenant shaped part of it.

kube-apiserver stores JSON nested thousands of levels deep in its free-form fields: a
ResourceClaim's opaque ``parameters`` (any driver's name will do) is one a tenant with ``edit``
writes; 5,100 levels of ``[`` were created on the project's v1.37.2 apiserver, and the 10,240-byte
cap on parameters is what bounds it. Python's decoder stops near its recursion limit, 1,000 frames,
with a RecursionError; before this module one such claim failed every LIST of claims cluster-wide
and every watch event that carried it, so the extender's DRA watch relisted for ever.

:func:`loads` decodes as ``json.loads`` does. When the decoder runs out of recursion, it decodes
again with every array or object nested deeper than :data:`MAX_DEPTH` replaced by ``null`` (no
Kubernetes object qgpu reads nests past about 15 levels, so only the tenant's free-form value is
cut), and logs how many values it cut. The reader then sees a ``null`` where the tenant put its
tower: another driver's claim is unaffected; a claim for qgpu's driver is refused by the config
reader naming the field, as any other malformed configuration. The cut is a regular-expression scan
(strings skipped whole, brackets counted) that runs only after a RecursionError.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

log = logging.getLogger(__name__)

MAX_DEPTH = 64
# a JSON string (escapes included), or one bracket; everything else is copied as it is
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_OPEN = frozenset(b"[{")


def loads(raw: bytes | bytearray | str) -> Any:
    """``raw`` decoded; values nested past :data:`MAX_DEPTH` become null when the decoder could not
    reach them (see the module docstring). Malformed JSON raises ValueError, as ``json.loads``."""
    try:
        return json.loads(raw)
    except RecursionError:
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        shallow, cut = cut_deep(data, MAX_DEPTH)
        log.warning("API JSON of %d bytes nests past the decoder's recursion limit: %d value(s) nested deeper than %d "
                    "levels read as null", len(data), cut, MAX_DEPTH)
        try:
            return json.loads(shallow)
        except RecursionError:  # brackets that never close: not JSON at all
            raise ValueError(f"API JSON of {len(data)} bytes: brackets nested past {MAX_DEPTH} levels never close") from None


def cut_deep(data: bytes, max_depth: int) -> tuple[bytes, int]:
    """``data`` with every array or object that opens below ``max_depth`` levels replaced by
    ``null``, and how many were replaced. Brackets inside strings are not counted."""
    out: list[bytes] = []
    copied = 0  # data[:copied] is in out
    depth = 0
    start = -1  # where the value being cut opened
    cut = 0
    for token in _TOKENS.finditer(data):
        first = data[token.start()]
        if first == 0x22:  # a string
            continue
        if first in _OPEN:
            depth += 1
            if depth == max_depth + 1:
                start = token.start()
            continue
        if depth == max_depth + 1 and start >= 0:
            out.append(data[copied:start])
            out.append(b"null")
            copied = token.end()
            start = -1
            cut += 1
        depth -= 1
    out.append(data[copied:])
    return b"".join(out), cut
