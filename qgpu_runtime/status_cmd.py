"""``qgpu status`` (also ``kubectl qgpu``): allocations per node and card, as a table or JSON.

Two sources, one view (:mod:`qgpu_runtime.status`):
- a cluster: node annotations ``qgpu.io/gpus`` (cards, written by the node manager) plus every
  live pod's ``qgpu.io/allocation`` record; what is used, from each node's manager pod's /metrics
  through the apiserver's pod proxy (the caller's ``pods/proxy`` permission);
- a standalone host or a node's own store: the SQLite file's ``meta``/``cards``/``shares`` tables
  (schema in docs/node-manager.md; the node manager and the standalone manager both write it).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from qgpu_runtime.contract import names
from qgpu_runtime.contract.cliflags import label_problem
from qgpu_runtime.contract.inventory import NodeInventoryError, parse_inventory
from qgpu_runtime.contract.names import ALLOCATION, INVENTORY, NODE_ISOLATION_POLICY, finished
from qgpu_runtime.contract.record import RecordError, parse_record
from qgpu_runtime.contract.signature import RecordVerifier, SigningKeyError, UntrustedRecord, trusted_record
from qgpu_runtime.contract.store import SchemaError, UnreadableStore, read_status
from qgpu_runtime.kube.reader import ApiCallError
from qgpu_runtime.model.requests import GPU_RESOURCES, KAI_ANNOTATIONS, KAI_SCHEDULER, RequestError, parse_pod
from qgpu_runtime.status import (
    MAX_METRICS_BYTES,
    CardStatus,
    NodeStatus,
    NodeUsage,
    PendingPod,
    UsageError,
    WorkloadShare,
    parse_usage,
    render_json,
    render_table,
    with_usage,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--kubeconfig", help="cluster to read (default: in-cluster, then ~/.kube/config)")
    source.add_argument("--standalone-db", type=Path, metavar="PATH",
                        help="read a standalone host's (or a node's) store instead of a cluster "
                             "(default: $QGPU_STANDALONE_DB when set and --kubeconfig is not given)")
    parser.add_argument("--node", action="append", default=[], help="only these nodes (repeatable)")
    parser.add_argument("--record-verify-key", type=Path, metavar="FILE",
                        help="the extender's Ed25519 public key (PEM): records it did not sign are listed as "
                             "UNVERIFIED and count in no card's allocation (without it records are shown unchecked)")
    parser.add_argument("--manager-namespace", default=None, metavar="NS",
                        help=f"namespace of the node managers whose /metrics give what is used (default: {names.MANAGER_NAMESPACE})")
    parser.add_argument("--no-usage", action="store_true",
                        help="show allocations only: read no manager's /metrics")


STANDALONE_DB_ENV = "QGPU_STANDALONE_DB"


def store_to_read(args: argparse.Namespace, environ: Mapping[str, str]) -> Path | None:
    """The store file to read: ``--standalone-db``, else ``$QGPU_STANDALONE_DB`` (the variable the
    standalone host's commands share) unless ``--kubeconfig`` names a cluster; None: a cluster."""
    if args.standalone_db:
        return args.standalone_db
    if args.kubeconfig is None and environ.get(STANDALONE_DB_ENV):
        return Path(environ[STANDALONE_DB_ENV])
    return None


def flag_problem(args: argparse.Namespace, store: Path | None) -> str | None:
    """Flags refused before anything is read (the flag, the value and the rule), or None."""
    empty = [n for n in args.node if not n.strip()]
    if empty:
        return "--node '': must name a node"
    if args.manager_namespace is not None:
        problem = label_problem("--manager-namespace", args.manager_namespace, "a namespace name")
        if problem:
            return problem
    if store is not None:
        cluster_only = [flag for flag, value in (("--record-verify-key", args.record_verify_key),
                                                 ("--manager-namespace", args.manager_namespace)) if value is not None]
        if cluster_only:
            return (f"{', '.join(cluster_only)} with the store {store}: only when reading a cluster (a store's records "
                    "are its own node manager's, and no manager's /metrics are read); drop them or give --kubeconfig")
    return None


def run(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    store = store_to_read(args, os.environ if environ is None else environ)
    problem = flag_problem(args, store)
    if problem:
        print(f"qgpu status: {problem}", file=sys.stderr)
        return 2
    pending: list[PendingPod] = []
    try:
        if store is not None:
            nodes = [read_store_status(store)]
        else:
            from qgpu_runtime.kube.reader import ClusterReader

            verifier = None
            if args.record_verify_key:
                verifier = RecordVerifier.from_pem(args.record_verify_key.read_bytes(), f"--record-verify-key {args.record_verify_key}")
            api = ClusterReader(args.kubeconfig)
            listed_nodes = api.list_nodes()
            pods = api.list_pods()
            nodes = cluster_status(listed_nodes, pods, verifier)
            pending = pending_gpu_pods(pods)
        if args.node:  # Pending pods are on no node: listed only for the whole cluster
            nodes, pending = [n for n in nodes if n.name in set(args.node)], []
        if store is None and not args.no_usage:  # only the shown nodes' managers are read
            nodes = with_usage(nodes, read_usage(api, [n.name for n in nodes], pods,
                                                 args.manager_namespace or names.MANAGER_NAMESPACE))
    except (StatusSourceError, ApiCallError, OSError, SigningKeyError) as exc:
        print(f"qgpu status: {exc}", file=sys.stderr)
        return 1
    print(render_json(nodes, pending) if args.json else render_table(nodes, pending))
    return 0


def kubectl_main(argv: Sequence[str] | None = None) -> int:
    """``kubectl qgpu [status] [--json] …``: the same command as a kubectl plugin."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["status"]:
        args = args[1:]
    parser = argparse.ArgumentParser(prog="kubectl qgpu", description="GPU allocations per node and card")
    add_arguments(parser)
    return run(parser.parse_args(args))


def manager_endpoints(pods: Iterable[Mapping[str, Any]], namespace: str) -> dict[str, list[tuple[str, int]]]:
    """Pure: node -> the (pod, metrics port) of each running node manager on it. Only pods in the
    managers' namespace count (a tenant's pod with the same label elsewhere is nobody's manager)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for pod in pods:
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        if (meta.get("namespace") != namespace or (meta.get("labels") or {}).get(names.MANAGER_APP_LABEL) != names.MANAGER_APP
                or meta.get("deletionTimestamp") or names.phase(dict(pod)) != names.RUNNING or not spec.get("nodeName")):
            continue
        ports = [p.get("containerPort") for c in spec.get("containers") or [] for p in (c or {}).get("ports") or []
                 if isinstance(p, Mapping) and p.get("name") == names.METRICS_PORT_NAME]
        if ports and isinstance(ports[0], int):
            out.setdefault(str(spec["nodeName"]), []).append((str(meta.get("name", "")), ports[0]))
    return {node: sorted(found) for node, found in out.items()}


USAGE_READERS = 8  # nodes whose managers are read at once


def read_usage(api: Any, node_names: Sequence[str], pods: Iterable[Mapping[str, Any]],
               namespace: str) -> dict[str, NodeUsage | str]:
    """Each node's used figures from its manager's /metrics (through ``api.pod_proxy_get``), or why
    not: no manager pod there, the proxy refused (``pods/proxy`` not granted), unreadable text."""
    endpoints = manager_endpoints(pods, namespace)

    def one(node: str) -> NodeUsage | str:
        found = endpoints.get(node)
        if not found:
            return f"no running {names.MANAGER_APP} pod with a {names.METRICS_PORT_NAME!r} port on it in namespace {namespace}"
        errors = []
        for pod, port in found:
            try:
                return parse_usage(node, api.pod_proxy_get(namespace, pod, port, "metrics", MAX_METRICS_BYTES))
            except (ApiCallError, UsageError) as exc:
                errors.append(str(exc))
        return "; ".join(errors)

    with ThreadPoolExecutor(max_workers=USAGE_READERS) as pool:
        return dict(zip(node_names, pool.map(one, node_names)))


class StatusSourceError(RuntimeError):
    """The store cannot be read as a qgpu store; the message names the file and what is missing."""


USAGE_STALE_S = 30.0
"""Used figures older than this are not shown: the standalone manager writes them every second
while it runs."""


def read_store_status(path: Path, now: float | None = None) -> NodeStatus:
    """One NodeStatus from a store file, opened read-only (works while a manager writes it), with
    what the standalone manager last sampled as used when that is fresh."""
    if not path.exists():
        raise StatusSourceError(f"{path}: no such store file")
    if not os.access(path, os.R_OK):
        st = path.stat()
        raise StatusSourceError(f"{path}: not readable by uid {os.getuid()} (owner uid {st.st_uid}, mode {st.st_mode & 0o7777:04o}): "
                                "run as the file's owner, or give readers a group (chmod 0640, chgrp)")
    try:
        rows = read_status(path)
    except (SchemaError, UnreadableStore) as exc:
        raise StatusSourceError(str(exc)) from None
    except sqlite3.Error as exc:
        raise StatusSourceError(f"{path}: not a qgpu store ({exc}); expected tables meta, cards, shares") from exc
    meta, cards, shares = rows.meta, rows.cards, rows.shares
    age = None if rows.sampled is None else (time.time() if now is None else now) - rows.sampled
    fresh = age is not None and age <= USAGE_STALE_S
    per_card: dict[int, list[WorkloadShare]] = {}
    for row in shares:
        problem = _bad_share(row)
        if problem:
            raise StatusSourceError(f"{path}: shares row of {row[1]!r} on card {row[3]!r}: {problem}")
        ns, workload, container, index, core, mem, klass = row
        name = "/".join(p for p in (ns, workload, container) if p)
        sm, used = rows.used.get((ns, workload, container, index), (0, 0)) if fresh else (None, None)
        per_card.setdefault(index, []).append(WorkloadShare(name, core, mem, klass, container=container,
                                                            used_core_pct=sm, used_memory_mib=used))
    out = []
    for i, u, m, mem in cards:
        card = _card(i, u, m, mem, per_card.get(i, []))
        if fresh:
            sm, used = rows.card_used.get(i, (0, 0))
            card = replace(card, util_pct=sm, memory_used_mib=used)
        out.append(card)
    stale = "" if age is None or fresh else f"the manager's last sample is {age:.0f} s old (over {USAGE_STALE_S:.0f} s): is it running?"
    return NodeStatus(name=meta.get("node", path.stem), policy=meta.get("policy", "-"), cards=tuple(out), usage_error=stale)


def _bad_share(row: Sequence[Any]) -> str | None:
    """Why a ``shares`` row (namespace, workload, container, card, core ‰, MiB, class) cannot be
    shown, or None: SQLite keeps whatever type a writer gave a column."""
    for field, value in zip(("namespace", "workload", "container", "class"), (row[0], row[1], row[2], row[6])):
        if not isinstance(value, str):
            return f"{field} {value!r} is not text"
    for field, value in zip(("card_index", "core_milli", "memory_mib"), row[3:6]):
        if type(value) is not int or value < 0:
            return f"{field} {value!r} is not an integer >= 0"
    return None


def _card(index: int, uuid: str, model: str, memory: int, work: list[WorkloadShare]) -> CardStatus:
    counted = [w for w in work if not w.unverified]
    return CardStatus(index, uuid, model, memory, sum(w.core_milli for w in counted), sum(w.memory_mib for w in counted),
                      tuple(work))


def cluster_status(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
                   verifier: RecordVerifier | None = None) -> list[NodeStatus]:
    """Pure: nodes' card annotations + live pods' allocation records -> one NodeStatus per node.

    With ``verifier`` (the extender's public key) a record it did not sign for its pod is listed,
    marked unverified, and counted in no card's allocation: that is how the extender and the node
    manager treat it. Without, records are shown as written."""
    known: dict[str, tuple[str, dict[int, tuple[str, str, int]]]] = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        notes = meta.get("annotations") or {}
        if INVENTORY not in notes:
            continue
        name = meta.get("name", "")
        try:
            cards = {c.index: (c.uuid, c.model, c.memory_mib) for c in parse_inventory(name, notes[INVENTORY])}
        except NodeInventoryError:
            cards = {}  # still listed, with the cards its pods' records name
        known[name] = (notes.get(NODE_ISOLATION_POLICY, "-"), cards)
    work: dict[tuple[str, int], list[WorkloadShare]] = {}
    seen_cards: dict[str, dict[int, str]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(ALLOCATION)
        if raw is None or finished(pod):
            continue
        unverified = False
        try:
            record = parse_record(raw)
            if verifier is not None:
                trusted_record(pod, verifier)
        except UntrustedRecord:
            unverified = True
        except RecordError:
            continue
        several = len(record.containers) > 1
        for c in record.containers:
            name = f"{meta.get('namespace', 'default')}/{meta.get('name', '')}" + (f"/{c.name}" if several else "")
            for s in c.shares:
                work.setdefault((record.node, s.index), []).append(WorkloadShare(name, s.core_milli, s.memory_mib, record.klass.value,
                                                                                  unverified, c.name))
                seen_cards.setdefault(record.node, {})[s.index] = s.uuid
    out = []
    for node in sorted(set(known) | set(seen_cards)):
        policy, cards = known.get(node, ("-", {}))
        indices = sorted(set(cards) | set(seen_cards.get(node, {})))
        out.append(NodeStatus(node, policy, tuple(
            _card(i, *(cards.get(i) or (seen_cards[node][i], "?", 0)), work.get((node, i), [])) for i in indices)))
    return out


# The ResourceClaimTemplates qgpu's webhook makes for a pod's GPU requests on DRA pools (webhook/dra.py).
_QGPU_TEMPLATE_PREFIX = "qgpu-"


def _asks(pod: Mapping[str, Any]) -> str:
    """The pod's GPU requests as its owner wrote them (limits, else requests), KAI's annotations,
    and the qgpu claim templates the webhook gave it on a DRA pool."""
    spec = pod.get("spec") or {}
    parts: list[str] = []
    for container in spec.get("containers") or []:
        resources = (container or {}).get("resources") or {}
        values = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        parts += [f"{k}={v}" for k, v in sorted(values.items()) if k in GPU_RESOURCES]
    if spec.get("schedulerName") == KAI_SCHEDULER:
        notes = (pod.get("metadata") or {}).get("annotations") or {}
        parts += [f"{k}={notes[k]}" for k in KAI_ANNOTATIONS if k in notes]
    for claim in spec.get("resourceClaims") or []:
        template = (claim or {}).get("resourceClaimTemplateName") or ""
        if template.startswith(_QGPU_TEMPLATE_PREFIX):
            parts.append(f"claim {template}")
    return ", ".join(parts)


def pending_gpu_pods(pods: Iterable[Mapping[str, Any]]) -> list[PendingPod]:
    """Pure: the pods asking for a GPU that no node runs yet (no nodeName, not finished), each with
    what the scheduler last said: PodScheduled's reason and message, "SchedulingGated" for a pod
    held by its scheduling gates, "NotTried" before the scheduler's first attempt."""
    out = []
    for pod in pods:
        spec = pod.get("spec") or {}
        if spec.get("nodeName") or finished(pod):
            continue
        asks = _asks(pod)
        try:
            wants = parse_pod(pod).wants_gpu or "claim " in asks
        except RequestError:
            wants = bool(asks)  # created past the webhook (before it, or exempt): shown as written
        if not wants:
            continue
        meta = pod.get("metadata") or {}
        scheduled = next((c for c in ((pod.get("status") or {}).get("conditions") or [])
                          if isinstance(c, Mapping) and c.get("type") == "PodScheduled"), None)
        if spec.get("schedulingGates"):  # the gate names say more than the apiserver's generic message
            reason, message = "SchedulingGated", "gates: " + ", ".join(str((g or {}).get("name")) for g in spec["schedulingGates"])
        elif scheduled is not None and scheduled.get("status") == "False":
            reason, message = str(scheduled.get("reason") or "Unschedulable"), str(scheduled.get("message") or "")
        else:
            reason, message = "NotTried", ""
        out.append(PendingPod(f"{meta.get('namespace', 'default')}/{meta.get('name', '')}", asks, reason, message))
    return sorted(out, key=lambda p: p.name)
