"""One document in one annotation of a coordination.k8s.io/v1 Lease, written on the version it was read at.

Both of qgpu's coordination documents (the extender's node commitments, the webhook's claim-quota
ledger) are such a text: a reader gets the text and the Lease's resourceVersion, decides, and
writes the new text back on that version. The apiserver lets one of two writers deciding on the
same version through and answers the other 409, raised here as
:class:`~qgpu_runtime.kube.errors.Conflict`: the loser reads again. A Lease that does not exist yet
is created, and a create racing another create is the same 409. The holder fields of the Lease
are not used (a replace writes an empty ``spec``). What the text says is the contract room's
business (:mod:`qgpu_runtime.contract.leases`); this module only moves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kubernetes import client

from qgpu_runtime.kube.client import raw_json
from qgpu_runtime.kube.errors import NotFound, call
from qgpu_runtime.kube.hotcalls import HotCalls
from qgpu_runtime.kube.retry import with_backoff

Timeout = tuple[float, float]


@dataclass(frozen=True)
class LeaseText:
    """A Lease's document as read: its annotation (None: the Lease has none) and resourceVersion."""

    text: str | None
    version: str


def _version(doc: Any) -> str:
    return str(((doc or {}).get("metadata") or {}).get("resourceVersion") or "")


class LeaseDocuments:
    """The Leases of ``namespace`` that carry a document in annotation ``annotation``.

    ``attempts`` > 1 retries transient failures with backoff (:mod:`~qgpu_runtime.kube.retry`); a
    retried write that already landed comes back as a Conflict, which only costs the caller a read.
    """

    def __init__(self, api: client.CoordinationV1Api, namespace: str, annotation: str, labels: Mapping[str, str],
                 hot: HotCalls | None = None) -> None:
        """``hot``: make the calls on that thin client (kube/hotcalls.py) instead of ``api``'s
        generated methods, for documents written once per pod."""
        self.api = api
        self.hot = hot
        self.namespace = namespace
        self.annotation = annotation
        self.labels = dict(labels)

    def read(self, name: str, *, timeout: Timeout, attempts: int = 1) -> LeaseText | None:
        """The document of Lease ``name``; None when there is no such Lease."""
        hot = self.hot
        try:
            if hot is not None:
                doc = with_backoff(lambda: call(hot.read_lease, self.namespace, name, timeout), attempts=attempts)
            else:
                doc = raw_json(with_backoff(lambda: call(self.api.read_namespaced_lease, name, self.namespace,
                                                         _preload_content=False, _request_timeout=timeout), attempts=attempts))
        except NotFound:
            return None
        annotations = (doc.get("metadata") or {}).get("annotations") or {}
        return LeaseText(annotations.get(self.annotation), _version(doc))

    def write(self, name: str, text: str, version: str | None, *, timeout: Timeout, attempts: int = 1) -> str:
        """Replace Lease ``name`` read at ``version`` with ``text`` (create it when ``version`` is
        None); the new resourceVersion ('' if the answer named none). Raises Conflict when the
        Lease changed (or appeared) meanwhile, and the call's other errors as mapped."""
        metadata: dict[str, Any] = {"name": name, "namespace": self.namespace, "labels": self.labels,
                                    "annotations": {self.annotation: text}}
        if version is not None:
            metadata["resourceVersion"] = version
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": {}}

        hot = self.hot

        def attempt() -> Any:
            if hot is not None:
                if version is None:
                    return call(hot.create_lease, self.namespace, body, timeout)
                return call(hot.replace_lease, self.namespace, name, body, timeout)
            if version is None:
                return raw_json(call(self.api.create_namespaced_lease, self.namespace, body, _preload_content=False,
                                     _request_timeout=timeout))
            return raw_json(call(self.api.replace_namespaced_lease, name, self.namespace, body, _preload_content=False,
                                 _request_timeout=timeout))

        return _version(with_backoff(attempt, attempts=attempts))
