"""The per-node commitment object in the API: a coordination.k8s.io/v1 Lease per node.

Lease ``qgpu-node.<node>`` in the extender's namespace carries the node's commitments in its
annotation ``qgpu.io/commitments`` (format and name: :mod:`qgpu_runtime.contract.leases`; read and
written through :mod:`qgpu_runtime.kube.leasedoc`). A Lease is used because it is small, namespaced
(so RBAC can grant exactly these objects and nothing else) and meant for coordination; its holder
fields are not used. Writes are conditional: a replace carries ``metadata.resourceVersion`` and the
apiserver answers 409 Conflict when anyone wrote in between; a create of a Lease someone else
created meanwhile is 409 AlreadyExists. Both become :class:`CommitmentConflict`, and the caller
re-reads and re-decides.

A store remembers the Lease each of its writes left (what the apiserver answered, resourceVersion
included) and hands that out as the next read of the node instead of asking again: with one active
binder, the usual case, a bind then costs one write instead of a read and a write (issue 14 §2:
the read was a quorum read through the apiserver to etcd). Safety does not rest on it being
current: a write made on a remembered Lease that anyone changed since fails on its resourceVersion
like any other, the store forgets the node, and the caller's re-read asks the apiserver.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from kubernetes import client

from qgpu_runtime.contract.leases import NodeCommitments, lease_name, parse_commitments
from qgpu_runtime.contract.names import COMMITMENTS
from qgpu_runtime.kube.client import REQUEST_TIMEOUT
from qgpu_runtime.kube.errors import Conflict
from qgpu_runtime.kube.hotcalls import HotCalls
from qgpu_runtime.kube.leasedoc import LeaseDocuments

LABELS = {"app.kubernetes.io/managed-by": "qgpu", "app.kubernetes.io/component": "node-commitments"}


class CommitmentConflict(Exception):
    """Someone else wrote the node's Lease since it was read: read again and decide again."""


@dataclass(frozen=True)
class Snapshot:
    """The node's commitments and the resourceVersion they were read at (None: no Lease yet)."""

    commitments: NodeCommitments
    resource_version: str | None


class LeaseCommitments:
    """Reads and conditionally writes the commitment Leases of one namespace."""

    # Leases remembered from this store's own writes (one small annotation each), least recent out first.
    MAX_REMEMBERED = 20_000

    def __init__(self, api: client.CoordinationV1Api, namespace: str, attempts: int = 5,
                 timeout: tuple[float, float] = REQUEST_TIMEOUT) -> None:
        self.api = api
        self.namespace = namespace
        # one write per GPU bind: on the thin client (kube/hotcalls.py)
        self.leases = LeaseDocuments(api, namespace, COMMITMENTS, LABELS, HotCalls(api.api_client))
        self.attempts = attempts
        self.timeout = timeout
        self.fresh_reads = 0  # GETs sent to the apiserver
        self._written: OrderedDict[str, Snapshot] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, node: str) -> Snapshot:
        """The node's commitments: as this store's last write left them, if it remembers one
        (see the module docstring), else as the apiserver has them now."""
        with self._lock:
            known = self._written.get(node)
            if known is not None:
                self._written.move_to_end(node)
                return known
        return self.read_fresh(node)

    def forget(self, node: str) -> None:
        with self._lock:
            self._written.pop(node, None)

    def _remember(self, node: str, snapshot: Snapshot) -> None:
        with self._lock:
            self._written[node] = snapshot
            self._written.move_to_end(node)
            while len(self._written) > self.MAX_REMEMBERED:
                self._written.popitem(last=False)

    def read_fresh(self, node: str) -> Snapshot:
        """The node's commitments as the apiserver has them now."""
        self.forget(node)
        self.fresh_reads += 1
        lease = self.leases.read(lease_name(node), timeout=self.timeout, attempts=self.attempts)
        if lease is None:
            return Snapshot(NodeCommitments(node), None)
        return Snapshot(parse_commitments(lease.text, node), lease.version)

    def write(self, snapshot: Snapshot, commitments: NodeCommitments) -> None:
        """Replace the Lease read as ``snapshot`` (create it when there was none) with ``commitments``.

        Raises :class:`CommitmentConflict` when it changed (or appeared) meanwhile. Transient
        failures are retried; a retried write that already landed comes back as a conflict, which
        only costs one more read.
        """
        name = lease_name(commitments.node)
        try:
            version = self.leases.write(name, commitments.to_json(), snapshot.resource_version, timeout=self.timeout,
                                        attempts=self.attempts)
        except Exception as exc:
            self.forget(commitments.node)  # whatever the apiserver holds now, it is not what we remember
            if isinstance(exc, Conflict):
                raise CommitmentConflict(f"lease {self.namespace}/{name} changed since it was read") from exc
            raise
        if version:
            self._remember(commitments.node, Snapshot(commitments, version))
        else:
            self.forget(commitments.node)
