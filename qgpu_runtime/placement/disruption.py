"""Which eviction candidates a PodDisruptionBudget protects, counted as kube-scheduler counts them.

kube-scheduler's DefaultPreemption does not refuse to violate a PodDisruptionBudget (it deletes its
victims, it does not ask the Eviction API): it *prefers* not to. On each node it splits the
candidates into those whose eviction would violate a budget and the others, tries to keep
(reprieve) the violating ones first, and among nodes it picks the one with the fewest violations
first. This module is that split (``filterPodsWithPDBViolation``), pure:

- a budget applies to the pods of its own namespace that its selector matches; a nil or empty
  selector matches nothing, a selector that cannot be read matches nothing, a pod without labels
  matches nothing;
- the candidates are taken in the given order (most valuable first, as kube-scheduler sorts them);
  each match uses one of the budget's ``status.disruptionsAllowed``; a pod is violating when any
  matching budget is overdrawn by it;
- a pod already in the budget's ``status.disruptedPods`` is being evicted through the apiserver and
  counts against nothing.

``disruptionsAllowed`` is what kube-controller-manager's disruption controller wrote; a budget
it has not processed yet reads 0, so all its pods count as violating (kube-scheduler reads it so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

# Bounds on what one budget may carry into the cache (a tenant writes budgets in its namespace).
MAX_SELECTOR_TERMS = 64
MAX_TERM_VALUES = 256  # in all the selector's terms: 64 terms of 256 each held 0.55 MB per budget
MAX_DISRUPTED = 1_000

_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


class SelectorError(ValueError):
    """A label selector this module cannot read (it then matches nothing)."""


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str
    values: frozenset[str]

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        if self.operator == "NotIn":
            return self.key not in labels or labels[self.key] not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels  # DoesNotExist


def parse_selector(selector: Any) -> tuple[Requirement, ...]:
    """A metav1.LabelSelector as requirements, all of which must hold. Empty: matches nothing here
    (a budget's empty selector selects no pod in policy/v1's use by kube-scheduler).

    Raises :class:`SelectorError` naming the field and the value for what the apiserver's
    validation would have refused."""
    if selector is None:
        return ()
    if not isinstance(selector, Mapping):
        raise SelectorError(f"selector: {type(selector).__name__}: must be an object")
    out: list[Requirement] = []
    values_in_all = 0
    match_labels = selector.get("matchLabels") or {}
    if not isinstance(match_labels, Mapping):
        raise SelectorError("selector.matchLabels: must be an object of strings")
    for key, value in match_labels.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SelectorError(f"selector.matchLabels[{key!r}]={value!r}: keys and values must be strings")
        out.append(Requirement(key, "In", frozenset([value])))
    expressions = selector.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise SelectorError("selector.matchExpressions: must be a list")
    for i, term in enumerate(expressions):
        where = f"selector.matchExpressions[{i}]"
        if not isinstance(term, Mapping):
            raise SelectorError(f"{where}: must be an object")
        key, operator, values = term.get("key"), term.get("operator"), term.get("values") or []
        if not isinstance(key, str) or not key:
            raise SelectorError(f"{where}.key={key!r}: must be a non-empty string")
        if operator not in _OPERATORS:
            raise SelectorError(f"{where}.operator={operator!r}: must be one of {', '.join(_OPERATORS)}")
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise SelectorError(f"{where}.values: must be a list of strings")
        values_in_all += len(values)
        if values_in_all > MAX_TERM_VALUES:
            raise SelectorError(f"{where}.values: {values_in_all} values in the selector's terms so far, at most "
                                f"{MAX_TERM_VALUES} in all")
        if operator in ("In", "NotIn") and not values:
            raise SelectorError(f"{where}.values: {operator} needs at least one value")
        if operator in ("Exists", "DoesNotExist") and values:
            raise SelectorError(f"{where}.values: {operator} takes no values")
        out.append(Requirement(key, operator, frozenset(values)))
    if len(out) > MAX_SELECTOR_TERMS:
        raise SelectorError(f"selector: {len(out)} requirements, at most {MAX_SELECTOR_TERMS}")
    return tuple(out)


@dataclass(frozen=True)
class Budget:
    """One PodDisruptionBudget as preemption reads it."""

    namespace: str
    name: str
    selector: tuple[Requirement, ...]  # empty: matches nothing
    allowed: int  # status.disruptionsAllowed
    disrupted: frozenset[str]  # status.disruptedPods: pod names

    def matches(self, namespace: str, labels: Mapping[str, str]) -> bool:
        return (namespace == self.namespace and bool(labels) and bool(self.selector)
                and all(r.matches(labels) for r in self.selector))


def budget_of(obj: Mapping[str, Any]) -> Budget:
    """A policy/v1 PodDisruptionBudget object as a :class:`Budget`. A selector that cannot be read
    gives a budget that matches nothing, as in kube-scheduler."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    try:
        selector = parse_selector(spec.get("selector"))
    except SelectorError:
        selector = ()
    allowed = status.get("disruptionsAllowed")
    if not isinstance(allowed, int) or isinstance(allowed, bool):
        allowed = 0
    disrupted = status.get("disruptedPods") or {}
    names = frozenset(k for k in list(disrupted)[:MAX_DISRUPTED] if isinstance(k, str)) \
        if isinstance(disrupted, Mapping) else frozenset()
    return Budget(str(meta.get("namespace") or ""), str(meta.get("name") or ""), selector, max(0, allowed), names)


@dataclass(frozen=True)
class PodLabels:
    """A candidate as the split needs it."""

    key: str  # namespace/name
    labels: Mapping[str, str]


def violating(pods: Sequence[PodLabels], budgets: Iterable[Budget]) -> frozenset[str]:
    """The keys of ``pods`` (most valuable first) whose eviction, together with the ones before
    them, would overdraw a budget that matches them (see the module docstring)."""
    by_namespace: dict[str, list[Budget]] = {}
    for b in budgets:
        by_namespace.setdefault(b.namespace, []).append(b)
    left: dict[tuple[str, str], int] = {}
    out = set()
    for pod in pods:
        namespace, _, name = pod.key.partition("/")
        for budget in by_namespace.get(namespace, ()):
            if name in budget.disrupted or not budget.matches(namespace, pod.labels):
                continue
            ident = (budget.namespace, budget.name)
            left[ident] = left.get(ident, budget.allowed) - 1
            if left[ident] < 0:
                out.add(pod.key)
    return frozenset(out)
