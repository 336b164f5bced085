"""Which pods' allocation records the cache believes, and the pod as the cache keeps it.

Only records the extender signed for their pod are booked (contract/signature.py): a pod's
annotations are its owner's to write, so a record without a valid signature, or signed for another
pod, node or bind-time, books nothing. :func:`entry_of` turns a pod from an event into the
``PodEntry`` the cache keeps, leaving an unbelieved record out; :class:`UntrustedRecords` remembers
which pods were refused and why, and reports each refusal once per change.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from qgpu_runtime.contract.names import FINISHED_PHASES
from qgpu_runtime.contract.record import ALLOCATION, BIND_TIME, RecordError
from qgpu_runtime.contract.signature import RecordVerifier, UntrustedRecord, trusted_record
from qgpu_runtime.extender.podstate import PodEntry
from qgpu_runtime.model.requests import pod_compute

TERMINAL_PHASES = FINISHED_PHASES


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"


def pod_priority(pod: Mapping[str, Any]) -> int:
    """``spec.priority``, which the apiserver's Priority admission computes from the PriorityClass
    (a pod may not state another); 0 without one, kube-scheduler's default (corev1helpers.PodPriority)."""
    value = (pod.get("spec") or {}).get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def entry_of(pod: Mapping[str, Any], verifier: RecordVerifier) -> tuple[PodEntry, str | None]:
    """The pod as the cache keeps it, and why its record is not believed (None: no record, or a
    signed one). An unbelieved record is left out of the entry: the pod books nothing."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    record_raw = annotations.get(ALLOCATION)
    refusal = None
    record = None
    if record_raw is not None:
        try:
            record = trusted_record(pod, verifier)
        except UntrustedRecord as exc:
            refusal, record_raw = str(exc), None
        except RecordError:
            pass  # malformed: the pod's booking sync reports it and books nothing
    try:
        bind_time: int | None = int(annotations.get(BIND_TIME, ""))
    except ValueError:
        bind_time = None
    cpu = mem = 0
    if record_raw is not None:  # CPU and memory only matter for pods that book cards
        cpu, mem = pod_compute(pod)
    nominated = (pod.get("status") or {}).get("nominatedNodeName")
    labels = meta.get("labels") or {}
    return PodEntry(
        key=pod_key(pod),
        uid=str(meta.get("uid") or ""),
        node_name=str((pod.get("spec") or {}).get("nodeName") or ""),
        record_raw=record_raw,
        bind_time_ns=bind_time,
        terminal=(pod.get("status") or {}).get("phase") in TERMINAL_PHASES,
        cpu_milli=cpu,
        memory_mib=mem,
        priority=pod_priority(pod),
        deleting=bool(meta.get("deletionTimestamp")),
        nominated=nominated if isinstance(nominated, str) else "",
        labels=tuple(sorted((k, v) for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)))
        if isinstance(labels, Mapping) else (),
        record=record,
    ), refusal


class UntrustedRecords:
    """Pod key → why its record was refused; a refusal is reported once, again only when it changes.
    Not thread-safe on its own: the cache's lock guards it."""

    def __init__(self, report: Callable[[str], None]) -> None:
        self._by_key: dict[str, str] = {}
        self._report = report

    def note(self, key: str, refusal: str | None) -> None:
        """The pod's latest verdict: None forgets it (trusted, no record, deleted or finished)."""
        if refusal is None:
            self._by_key.pop(key, None)
        elif self._by_key.get(key) != refusal:
            self._by_key[key] = refusal
            self._report(f"pod {key}: allocation record not trusted, booked nowhere: {refusal}")

    def copy(self) -> dict[str, str]:
        return dict(self._by_key)
