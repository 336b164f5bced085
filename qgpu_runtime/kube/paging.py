"""Reading a LIST a page at a time, each page's body read to a cap.

A LIST answer is as large as what its objects' writers made them: a tenant's pods and claims near
etcd's 1.5 MiB object limit, a compromised node's ResourceSlices. Read in one answer and decoded
whole, a few dozen such objects cost a reader several hundred MiB. A reader that pages (``limit``,
the continue token: one consistent snapshot) and reduces each page before asking for the next
holds one page; :func:`read_capped` bounds the page's body, and the caller asks a page past the cap
again with fewer items.
"""

from __future__ import annotations

from typing import Any, Final

LIST_PAGE_ITEMS: Final = 100
"""Objects asked per page of a LIST (``limit``)."""
LIST_PAGE_BYTES: Final = 4 * 1024 * 1024
"""The most of one page's body read: past it the page is asked again with a quarter of the items
(an object may be near etcd's 1.5 MiB), down to one; a single object past it cannot be read."""


def read_capped(response: Any, cap: int) -> bytes | None:
    """The body of a ``_preload_content=False`` response, or None (the connection closed, not
    returned to the pool with the rest unread) once it runs past ``cap`` bytes."""
    chunks: list[bytes] = []
    total = 0
    try:
        while True:
            chunk = response.read(64 * 1024)
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > cap:
                response.close()
                return None
            chunks.append(chunk)
    finally:
        response.release_conn()


def continue_token(page: Any) -> str | None:
    """The continue token of a decoded LIST page, None on its last page."""
    metadata = page.get("metadata") if isinstance(page, dict) else None
    token = metadata.get("continue") if isinstance(metadata, dict) else None
    return token if isinstance(token, str) and token else None
