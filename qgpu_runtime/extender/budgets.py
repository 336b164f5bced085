"""The cluster's PodDisruptionBudgets, as the preempt verb reads them (placement/disruption.py).

Fed by the extender's list-then-watch of ``policy/v1`` PodDisruptionBudgets (extender/watch.py;
the ClusterRole grants list and watch only). A budget is written by whoever may write budgets in
its namespace and protects only that namespace's pods, so a tenant can shield its own pods from
eviction by preemption, never another namespace's; and it only shields them as kube-scheduler
does: a protected pod is evicted last, not never. ``MAX_BUDGETS_PER_NAMESPACE`` bounds what one
namespace costs a preempt call (the newest beyond it are left out, with a problem reported once).
Thread-safe.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Mapping

from qgpu_runtime.placement.disruption import Budget, budget_of

MAX_BUDGETS_PER_NAMESPACE = 256


class DisruptionBudgets:
    def __init__(self, problem: Callable[[str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._by_namespace: dict[str, dict[str, Budget]] = {}
        self._over: set[str] = set()
        self._problem = problem or (lambda message: None)

    def replace(self, objects: Iterable[Mapping[str, Any] | Budget]) -> None:
        """Every budget, as objects or as a LIST already reduced them (extender/watch.py)."""
        fresh = [obj if isinstance(obj, Budget) else budget_of(obj) for obj in objects]
        with self._lock:
            self._by_namespace = {}
            for b in fresh:
                self._put(b)

    def apply(self, event: str, obj: Mapping[str, Any]) -> None:
        b = budget_of(obj)
        with self._lock:
            if event == "DELETED":
                names = self._by_namespace.get(b.namespace, {})
                names.pop(b.name, None)
                if not names:
                    self._by_namespace.pop(b.namespace, None)
                return
            self._put(b)

    def _put(self, b: Budget) -> None:
        names = self._by_namespace.setdefault(b.namespace, {})
        if b.name not in names and len(names) >= MAX_BUDGETS_PER_NAMESPACE:
            if b.namespace not in self._over:
                self._over.add(b.namespace)
                self._problem(f"namespace {b.namespace}: more than {MAX_BUDGETS_PER_NAMESPACE} "
                              f"PodDisruptionBudgets; preemption reads the first {MAX_BUDGETS_PER_NAMESPACE}")
            return
        names[b.name] = b

    def in_namespaces(self, namespaces: Iterable[str]) -> list[Budget]:
        with self._lock:
            return [b for ns in set(namespaces) for b in self._by_namespace.get(ns, {}).values()]
