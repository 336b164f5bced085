"""Decoding a JSON document whose top-level type is fixed, with errors that say what was read.

The extender's and webhook's request bodies, the allocation record and the node inventory
annotation all start the same way: decode, then insist on an object (or a list). Each caller
passes its own error class and a name for the document, so the message stays in its words.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

_KIND = {dict: "object", list: "list"}


def load_json(raw: bytes | str, kind: type, what: str, error: Callable[[str], Exception]) -> Any:
    """``raw`` decoded, if it is a JSON value of ``kind`` (dict or list); else ``error(message)``
    is raised, the message starting with ``what``."""
    try:
        doc = json.loads(raw)
    except (TypeError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise error(f"{what} is not JSON ({exc})") from exc
    except RecursionError as exc:
        # '[[[[…' past the interpreter's recursion limit: the decoder unwinds cleanly, and what a
        # tenant wrote into an annotation must be refused like any other malformed value, never
        # escape as an exception its readers do not expect (a watch that stops on it)
        raise error(f"{what} is not JSON qgpu decodes: arrays and objects nested deeper than the decoder's "
                    f"recursion limit ({sys.getrecursionlimit()} frames) reaches") from exc
    if not isinstance(doc, kind):
        raise error(f"{what} is a JSON {_KIND.get(type(doc), type(doc).__name__)}: must be a JSON {_KIND[kind]}")
    return doc
