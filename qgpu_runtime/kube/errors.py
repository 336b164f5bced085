"""The one error mapping of the Kubernetes API edge: every failed call becomes one classified error.

:func:`call` runs a client method and raises what went wrong as one of these classes::

    KubeError                      any failed call
    ├── ApiError                   the apiserver answered with an error status (403, 422, …)
    │   ├── NotFound               404: the object does not exist
    │   ├── Conflict               409: a stale resourceVersion, or a create of what exists
    │   └── Unavailable            429, 5xx, status 0 or none: it could not serve the call now
    └── Transient                  a retry may succeed (kube/retry.py retries exactly these)
        ├── Unavailable
        └── Unreachable            no HTTP answer: refused or reset connections, timeouts

An :class:`ApiError` carries the status, the reason and the apiserver's own message, parsed once
(:func:`status_message`) from the error body. The three ways qgpu quotes a failure in its messages
are methods here (``str``, :meth:`~KubeError.brief`, :meth:`~KubeError.described`), so every
message keeps its words.
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

import urllib3
from kubernetes.client.exceptions import ApiException

T = TypeVar("T")

# Statuses a retry can fix (:class:`Unavailable`): throttling, the apiserver or etcd failing, and the
# client's own 0 (its TLS errors), besides no status at all.
TRANSIENT_STATUS = frozenset({0, 429, 500, 502, 503, 504})
# No HTTP answer: refused, reset or dropped connections, timeouts (TimeoutError is an OSError).
UNREACHABLE = (urllib3.exceptions.HTTPError, OSError)


def status_message(body: Any) -> str | None:
    """The apiserver's ``Status.message`` in an error body; None when the body carries none."""
    try:
        message = json.loads(body or "{}").get("message")
    except (ValueError, AttributeError, TypeError):
        return None
    return str(message) if message else None


def _named(exc: BaseException, reason: bool = False) -> str:
    """``<type>: <text>``; with ``reason``, the wrapped error where there is one (urllib3's
    MaxRetryError wraps the socket error as ``reason``)."""
    inner = getattr(exc, "reason", None) if reason else None
    return f"{type(exc).__name__}: {inner or exc}"


class KubeError(Exception):
    """A failed API call."""

    def brief(self) -> str:
        """The short form of the extender's bind messages."""
        return _named(self)

    def described(self) -> str:
        """The node manager's form."""
        return _named(self, reason=True)


class Transient(KubeError):
    """A failure a retry may fix: the apiserver could not serve the call now, or was not reached."""


class ApiError(KubeError):
    """The apiserver refused the call; ``message`` is its own words, None if the body had none."""

    def __init__(self, status: int | None, reason: Any = "", body: Any = "") -> None:
        self.status = status
        self.reason = reason
        self.body = body
        self.message = status_message(body)
        super().__init__(status, reason)

    def __str__(self) -> str:
        """``403 Forbidden: <the apiserver's message>``: what a refusal to our caller quotes."""
        return f"{self.status} {self.reason}: {self.message or self.body}"

    def brief(self) -> str:
        """``403 <message or reason>``."""
        return f"{self.status} {self.message or self.reason}"

    def described(self) -> str:
        """``HTTP 403 <message or reason>``."""
        return f"HTTP {self.status} {self.message or self.reason}"


class NotFound(ApiError):
    """404: the object does not exist."""


class Conflict(ApiError):
    """409: the object changed since the resourceVersion given, or a create found it existing."""


class Unavailable(ApiError, Transient):
    """429, 5xx, the client's status 0 (its TLS errors) or none: the apiserver could not serve the call now."""


class Unreachable(Transient):
    """No HTTP answer at all (refused, reset, timed out); ``cause`` is the network error."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        super().__init__(cause)

    def __str__(self) -> str:
        return str(self.cause)

    def brief(self) -> str:
        return _named(self.cause)

    def described(self) -> str:
        return _named(self.cause, reason=True)


def classify(exc: ApiException) -> ApiError:
    """The class of an :class:`ApiException` by its status."""
    status = exc.status
    kind: type[ApiError]
    if status == 404:
        kind = NotFound
    elif status == 409:
        kind = Conflict
    elif status is None or status in TRANSIENT_STATUS:
        kind = Unavailable
    else:
        kind = ApiError
    return kind(status, exc.reason, exc.body)


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` (a client method), its failure raised as a :class:`KubeError`."""
    try:
        return fn(*args, **kwargs)
    except ApiException as exc:
        raise classify(exc) from exc
    except UNREACHABLE as exc:
        raise Unreachable(exc) from exc


def brief(exc: BaseException) -> str:
    """:meth:`KubeError.brief` of an API failure (classified first if raw); ``<type>: <text>`` of anything else."""
    if isinstance(exc, ApiException):
        exc = classify(exc)
    return exc.brief() if isinstance(exc, KubeError) else _named(exc)


def described(exc: BaseException) -> str:
    """:meth:`KubeError.described` of an API failure; ``<type>: <reason or text>`` of anything else."""
    if isinstance(exc, ApiException):
        exc = classify(exc)
    return exc.described() if isinstance(exc, KubeError) else _named(exc, reason=True)
