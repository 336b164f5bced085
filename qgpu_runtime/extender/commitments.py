"""The per-node commitment object in the API: a coordination.k8s.io/v1 Lease per node.

Lease ``qgpu-node.<node>`` in the extender's namespace carries the node's commitments in its
annotation ``qgpu.io/commitments`` (format: :mod:`qgpu_runtime.placement.commitments`). A Lease is
used because it is small, namespaced (so RBAC can grant exactly these objects and nothing else) and
meant for coordination; its holder fields are not used. Writes are conditional: a replace carries
``metadata.resourceVersion`` and the apiserver answers 409 Conflict when anyone wrote in between; a
create of a Lease someone else created meanwhile is 409 AlreadyExists. Both become
:class:`CommitmentConflict`, and the caller re-reads and re-decides.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract.names import COMMITMENTS_LEASE_PREFIX
from qgpu_runtime.kube.client import REQUEST_TIMEOUT, drain, raw_json
from qgpu_runtime.kube.retry import with_backoff
from qgpu_runtime.placement.commitments import COMMITMENTS, NodeCommitments, parse_commitments

LEASE_PREFIX = COMMITMENTS_LEASE_PREFIX
MAX_NAME = 253
LABELS = {"app.kubernetes.io/managed-by": "qgpu", "app.kubernetes.io/component": "node-commitments"}


class CommitmentConflict(Exception):
    """Someone else wrote the node's Lease since it was read: read again and decide again."""


def lease_name(node: str) -> str:
    """``qgpu-node.<node>``; a node name too long for the prefix is replaced by its digest."""
    name = LEASE_PREFIX + node
    if len(name) <= MAX_NAME:
        return name
    return LEASE_PREFIX + hashlib.sha256(node.encode()).hexdigest()


@dataclass(frozen=True)
class Snapshot:
    """The node's commitments and the resourceVersion they were read at (None: no Lease yet)."""

    commitments: NodeCommitments
    resource_version: str | None


class LeaseCommitments:
    """Reads and conditionally writes the commitment Leases of one namespace."""

    def __init__(self, api: client.CoordinationV1Api, namespace: str, attempts: int = 5,
                 timeout: tuple[float, float] = REQUEST_TIMEOUT) -> None:
        self.api = api
        self.namespace = namespace
        self.attempts = attempts
        self.timeout = timeout

    def read(self, node: str) -> Snapshot:
        name = lease_name(node)
        try:
            doc = raw_json(with_backoff(lambda: self.api.read_namespaced_lease(
                name, self.namespace, _preload_content=False, _request_timeout=self.timeout), attempts=self.attempts))
        except ApiException as exc:
            if exc.status == 404:
                return Snapshot(NodeCommitments(node), None)
            raise
        meta = doc.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(COMMITMENTS)
        return Snapshot(parse_commitments(raw, node), str(meta.get("resourceVersion") or ""))

    def write(self, snapshot: Snapshot, commitments: NodeCommitments) -> None:
        """Replace the Lease read as ``snapshot`` (create it when there was none) with ``commitments``.

        Raises :class:`CommitmentConflict` when it changed (or appeared) meanwhile. Transient
        failures are retried; a retried write that already landed comes back as a conflict, which
        only costs one more read.
        """
        name = lease_name(commitments.node)
        metadata: dict[str, Any] = {"name": name, "namespace": self.namespace, "labels": LABELS,
                                    "annotations": {COMMITMENTS: commitments.to_json()}}
        if snapshot.resource_version is not None:
            metadata["resourceVersion"] = snapshot.resource_version
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": {}}

        def attempt() -> None:
            if snapshot.resource_version is None:
                drain(self.api.create_namespaced_lease(self.namespace, body, _preload_content=False,
                                                       _request_timeout=self.timeout))
            else:
                drain(self.api.replace_namespaced_lease(name, self.namespace, body, _preload_content=False,
                                                        _request_timeout=self.timeout))

        try:
            with_backoff(attempt, attempts=self.attempts)
        except ApiException as exc:
            if exc.status == 409:
                raise CommitmentConflict(f"lease {self.namespace}/{name} changed since it was read") from exc
            raise
