"""Reading a LIST a page at a time, each page's body read to a cap.

A LIST answer is as large as what its objects' writers made them: a tenant's pods and claims near
etcd's 1.5 MiB object limit, a compromised node's ResourceSlices. Read in one answer and decoded
whole, a few dozen such objects cost a reader several hundred MiB. A reader that pages (``limit``,
the continue token: one consistent snapshot) and reduces each page before asking for the next
holds one page; :func:`read_capped` bounds the page's body, and the caller asks a page past the cap
again with fewer items.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Final, Iterator

from qgpu_runtime.kube import apijson

LIST_PAGE_ITEMS: Final = 100
"""Objects asked per page of a LIST (``limit``)."""
LIST_PAGE_BYTES: Final = 4 * 1024 * 1024
"""The most of one page's body read: past it the page is asked again with a quarter of the items
(an object may be near etcd's 1.5 MiB), down to one, whose body may be up to :data:`OBJECT_BYTES`."""
OBJECT_BYTES: Final = 16 * 1024 * 1024
"""The most of a one-object page's body read. etcd's limit is on the stored (protobuf) object; the
apiserver's JSON escapes ``<``, ``>``, ``&`` and control characters to six bytes each, so a pod of
0.9 MB of ``<`` in one env value is served past 4 MiB (tests/k8s/test_e2e_pod_bulk.py). Every
object the apiserver stores fits (1.5 MiB times six and its keys); a LIST that a single object
stopped (its reader relisting for ever, as the extender's pod watch did) is the attack this bound
must not allow."""


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


class PageTooLarge(Exception):
    """One object's body is larger than :data:`OBJECT_BYTES`: the LIST cannot be read."""


def pages(fetch: Callable[[int, str | None], Any], *,
          guard: Callable[[], AbstractContextManager[Any]] = nullcontext) -> Iterator[list[dict[str, Any]]]:
    """The items of a LIST, a decoded page at a time; the caller reduces each before the next is
    read. ``fetch(limit, token)`` makes the call (with the caller's timeouts and error mapping) and
    returns the ``_preload_content=False`` response, or None for an empty answer (a kind the
    apiserver does not serve). ``guard()`` is held while a page is read and decoded (a bound on
    the pages held at once). Raises :class:`PageTooLarge`, and ValueError for a body that is not
    JSON."""
    for items, _ in _pages(fetch, guard):
        yield items
        del items  # not held while the next page is read


def paged_list(fetch: Callable[[int, str | None], Any], reduce: Callable[[dict[str, Any]], Any]) -> tuple[list[Any], str]:
    """Every item of a LIST through ``reduce`` (what is kept of it), and the list's resourceVersion."""
    kept: list[Any] = []
    version = ""
    for items, page_version in _pages(fetch, nullcontext):
        kept.extend(reduce(item) for item in items)
        version = page_version or version
        del items  # not held while the next page is read
    return kept, version


def _pages(fetch: Callable[[int, str | None], Any],
           guard: Callable[[], AbstractContextManager[Any]]) -> Iterator[tuple[list[dict[str, Any]], str]]:
    token: str | None = None
    limit = LIST_PAGE_ITEMS
    while True:
        with guard():
            response = fetch(limit, token)
            cap = OBJECT_BYTES if limit == 1 else LIST_PAGE_BYTES
            body = b"{}" if response is None else read_capped(response, cap)
            del response
            if body is None:
                if limit == 1:
                    raise PageTooLarge(f"one object's body is larger than {OBJECT_BYTES} bytes")
                limit = max(1, limit // 4)
                continue
            page = apijson.loads(body)
            del body
            found = page.get("items") if isinstance(page, dict) else None
            items = [i for i in found or [] if isinstance(i, dict)]
            metadata = page.get("metadata") if isinstance(page, dict) else None
            version = str(metadata.get("resourceVersion") or "") if isinstance(metadata, dict) else ""
            token = continue_token(page)
            del page, found
        yield items, version
        del items  # not held while the next page is read
        if token is None:
            return
