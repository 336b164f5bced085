"""T9k groups, all or none: the members of a group are held at bind until every member is placed.

A T9k pod names its group with the label ``scheduler.tensorstack.dev/group-name``; the group is
that label value *within the pod's namespace* (a tenant cannot pull another namespace's pods into
its group). The label carries no size, and the Kubernetes gang of the supported releases (the
Workload API behind ``GenericWorkload``) needs a ``spec.schedulingGroup`` a T9k pod lacks, so the
extender holds the group itself:

- the group's *size* is the number of its live (non-terminal) pods the watch knows, raised to the
  largest ``qgpu.io/group-min-member`` annotation among them (for a group whose pods are created
  one by one: without it the first pod alone would be a complete group of one);
- a group none of whose pods states its size that way *settles*: it is not complete until its
  newest member has been known for ``settle`` (``--group-settle``, default 5 s), so the pods a
  controller is still creating one after another join it rather than forming groups of their own;
- a member is *placed* when it is bound, its Binding is in flight (its booking is pinned), or it is
  *held*: its bind chose and booked its cards, and was answered with an error so kube-scheduler
  retries it, while the cards stay booked (the same pinned booking a bind in flight has);
- the group is complete when as many members are placed as its size; the bind that completes it
  binds every held member with its held placement. The watch may lag behind kube-scheduler (pods
  created together, the first already at bind before the extender saw the others), so before a
  group counts as complete its pods are listed from the apiserver and counted too.

A mirror pod (a static pod's, :data:`~qgpu_runtime.contract.names.MIRROR_POD`, or a pod a Node
controls) is never a member: NodeRestriction lets a node create such pods, bound to itself, in any
namespace and with any labels, so a compromised node could otherwise join a victim's group, raise its
size to 64 or count as placed members that never ran.

Bounds, because the label is tenant-writable: at most :data:`MAX_GROUP_MEMBERS` members, held
members count against ``--max-holds`` and ``--max-holds-per-namespace`` like every pod awaiting its
bind, and a group's holds end ``timeout`` after its first one; it then rests as long before it may
hold again (:meth:`Groups.expire`), so a group that cannot fit leaves the cards to others.

Not thread-safe on its own: the cache's lock guards it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from qgpu_runtime.contract.names import GROUP_LABEL, GROUP_MIN_MEMBER, mirror_pod
from qgpu_runtime.contract.record import AllocationRecord
from qgpu_runtime.model.quantity import show_value

MIN_MEMBER_ANNOTATION = GROUP_MIN_MEMBER  # the user writes it; the roles' policy leaves it open
MAX_GROUP_MEMBERS = 64
_MIN_MEMBER_DIGITS = len(str(MAX_GROUP_MEMBERS))
DEFAULT_GROUP_TIMEOUT_S = 60.0
MAX_GROUP_TIMEOUT_S = 600.0
DEFAULT_GROUP_SETTLE_S = 5.0
MAX_GROUP_SETTLE_S = 60.0


class GroupError(ValueError):
    """A group's pod cannot be held: bad annotation, too many members, or the group is resting."""


@dataclass(frozen=True, order=True)
class GroupKey:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def from_node(pod: Mapping[str, Any]) -> bool:
    """A mirror pod: it carries the kubelet's mirror annotation, or a Node is its controller."""
    if mirror_pod(pod):
        return True
    refs = (pod.get("metadata") or {}).get("ownerReferences")
    return isinstance(refs, list) and any(
        isinstance(r, Mapping) and r.get("kind") == "Node" and r.get("controller") is True for r in refs)


def group_of(pod: Mapping[str, Any]) -> GroupKey | None:
    """The pod's group (namespace + label value), None when it names none or is a mirror pod."""
    meta = pod.get("metadata") or {}
    name = (meta.get("labels") or {}).get(GROUP_LABEL)
    if not name or from_node(pod):
        return None
    return GroupKey(meta.get("namespace") or "default", str(name))


def min_members(pod: Mapping[str, Any]) -> int:
    """The pod's ``qgpu.io/group-min-member`` (1 when absent); :class:`GroupError` naming the pod,
    the annotation, the value (cut) and the rule when it is not an integer in 1..MAX_GROUP_MEMBERS.

    Only ASCII digits, at most as many as MAX_GROUP_MEMBERS has: ``str.isdigit`` also passes "²"
    or "①", which ``int`` refuses with a ValueError (so does a 5,000-digit string), and that error
    broke the extender's pod watch on every event and relist (docs/security.md)."""
    meta = pod.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(MIN_MEMBER_ANNOTATION)
    if raw is None:
        return 1
    text = str(raw).strip()
    if not (text.isascii() and text.isdigit() and len(text) <= _MIN_MEMBER_DIGITS) \
            or not 1 <= int(text) <= MAX_GROUP_MEMBERS:
        raise GroupError(f"pod {meta.get('namespace') or 'default'}/{meta.get('name')}: annotation "
                         f"{MIN_MEMBER_ANNOTATION}={show_value(repr(raw))}: must be an integer in 1..{MAX_GROUP_MEMBERS}")
    return int(text)


@dataclass(frozen=True)
class HeldMember:
    """A member whose bind chose and booked its cards and waits for its group."""

    key: str
    uid: str
    node: str
    record: AllocationRecord
    chosen_ns: int  # the time the record was chosen at (its bind time when it is bound)


@dataclass(frozen=True)
class Progress:
    """Where a group stands: ``placed`` of ``size`` members (bound, binding or held)."""

    group: GroupKey
    size: int
    placed: int
    members: int
    settling_ns: int = 0  # how much longer a group of unstated size waits for members still being created

    @property
    def complete(self) -> bool:
        return self.placed >= self.size and self.settling_ns <= 0

    def waiting(self) -> str:
        if self.placed >= self.size:
            return (f"group {self.group} ({GROUP_LABEL}) has all {self.size} known members placed and waits "
                    f"{self.settling_ns / 1e9:.1f} s more for members still being created (its newest member "
                    f"appeared just now; the annotation {MIN_MEMBER_ANNOTATION} states the size and skips the wait)")
        return (f"group {self.group} ({GROUP_LABEL}) waits for {self.size - self.placed} more of {self.size} "
                f"members to be placed")


@dataclass(frozen=True)
class Listed:
    """A member as a fresh LIST of the group's pods shows it."""

    key: str
    bound: bool
    min_members: int
    stated: bool = False  # the pod carries the size annotation

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> "Listed | None":
        """None for a pod that is no member (a mirror pod, :func:`group_of`)."""
        if group_of(pod) is None:
            return None
        meta = pod.get("metadata") or {}
        try:
            wanted = min_members(pod)
        except GroupError:
            wanted = 1  # that pod's own filter and bind refuse it with the reason
        return cls(f"{meta.get('namespace') or 'default'}/{meta.get('name')}",
                   bool((pod.get("spec") or {}).get("nodeName")), wanted, _states_size(pod))


def _states_size(pod: Mapping[str, Any]) -> bool:
    return MIN_MEMBER_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {})


@dataclass(frozen=True)
class _Member:
    group: GroupKey
    uid: str
    bound: bool
    min_members: int  # 1 for a bad annotation: the bind of that pod is refused with the reason
    stated: bool = False  # it carries the size annotation
    seen_ns: int = 0  # when this extender first knew the pod


@dataclass
class _GroupHolds:
    held: dict[str, HeldMember] = field(default_factory=dict)
    since_ns: int = 0  # the first hold of this round


class Groups:
    """Group membership from the watch, each group's held members and its rest after a timeout."""

    def __init__(self, timeout_ns: int, settle_ns: int = 0, clock_ns: Callable[[], int] = time.time_ns) -> None:
        if timeout_ns <= 0:
            raise ValueError(f"group timeout {timeout_ns} ns: must be > 0")
        if not 0 <= settle_ns < timeout_ns:
            raise ValueError(f"group settle {settle_ns} ns: must be >= 0 and below the timeout")
        self.timeout_ns = timeout_ns
        self.settle_ns = settle_ns
        self.clock_ns = clock_ns
        self._members: dict[str, _Member] = {}  # pod key -> its group, for live pods that name one
        self._by_group: dict[GroupKey, set[str]] = {}
        self._holds: dict[GroupKey, _GroupHolds] = {}
        self._resting: dict[GroupKey, int] = {}  # group -> until when it may not hold

    # -- membership, from watch events -----------------------------------------------------------
    def observe(self, key: str, pod: Mapping[str, Any], gone: bool, bound: bool) -> HeldMember | None:
        """One watch event of pod ``key``; the hold it ends (the pod is gone or replaced), if any."""
        group = None if gone else group_of(pod)
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        old = self._members.get(key)
        if old is not None and (group != old.group or uid != old.uid):
            self._leave(key, old.group)
        ended = None
        if gone or (old is not None and old.uid != uid):
            ended = self.drop_hold(key)
        if group is None:
            return ended
        try:
            wanted = min_members(pod)
        except GroupError:
            wanted = 1
        seen = old.seen_ns if old is not None and old.uid == uid and old.group == group else self.clock_ns()
        self._members[key] = _Member(group, uid, bound, wanted, _states_size(pod), seen)
        self._by_group.setdefault(group, set()).add(key)
        return ended

    def _leave(self, key: str, group: GroupKey) -> None:
        self._members.pop(key, None)
        keys = self._by_group.get(group)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_group[group]

    # -- holds -----------------------------------------------------------------------------------
    def held(self, key: str) -> HeldMember | None:
        member = self._members.get(key)
        holds = self._holds.get(member.group) if member else None
        return holds.held.get(key) if holds else None

    def resting_until(self, group: GroupKey, now_ns: int) -> int | None:
        until = self._resting.get(group)
        if until is not None and until <= now_ns:
            del self._resting[group]
            return None
        return until

    def check_may_hold(self, group: GroupKey, key: str, now_ns: int) -> None:
        """:class:`GroupError` when the group is resting after a timeout or has too many members."""
        until = self.resting_until(group, now_ns)
        if until is not None:
            raise GroupError(f"group {group}: its held placements were released after {self.timeout_ns / 1e9:g} s "
                             f"(--group-timeout) without the group complete; it holds again in "
                             f"{max(0.0, (until - now_ns) / 1e9):.0f} s, the cards are left to other pods until then")
        members = len(self._by_group.get(group, ()) | {key})
        if members > MAX_GROUP_MEMBERS:
            raise GroupError(f"group {group} has {members} live members: at most {MAX_GROUP_MEMBERS} are held "
                             "together; split the group")

    def hold(self, group: GroupKey, member: HeldMember, now_ns: int) -> None:
        holds = self._holds.get(group)
        if holds is None or not holds.held:
            holds = self._holds[group] = _GroupHolds(since_ns=now_ns)
        holds.held[member.key] = member

    def drop_hold(self, key: str) -> HeldMember | None:
        for group, holds in list(self._holds.items()):
            member = holds.held.pop(key, None)
            if member is not None:
                if not holds.held:
                    del self._holds[group]
                return member
        return None

    def take(self, group: GroupKey) -> list[HeldMember]:
        """Every held member of the group, now no longer held (their binds are about to go out)."""
        holds = self._holds.pop(group, None)
        return sorted(holds.held.values(), key=lambda m: m.key) if holds else []

    def progress(self, group: GroupKey, arriving: str, placed: Iterable[str],
                 listed: Iterable[Listed] = ()) -> Progress:
        """``placed``: the keys of the group's members that are bound or whose bind is in flight
        (pinned bookings, the held ones among them); ``arriving`` is counted as placed and a member;
        ``listed``: members read from the apiserver just now, which the watch may not have delivered."""
        extra = {m.key: m for m in listed}
        keys = self._by_group.get(group, set()) | {arriving} | extra.keys()
        done = {k for k in placed if k in keys} | {arriving} | {k for k, m in extra.items() if m.bound}
        holds = self._holds.get(group)
        if holds is not None:
            done |= holds.held.keys() & keys
        done |= {k for k in keys if (m := self._members.get(k)) is not None and m.bound}
        known = [m for k in keys if (m := self._members.get(k)) is not None]
        wanted = max([m.min_members for m in known] + [m.min_members for m in extra.values()] + [1])
        settling = 0
        if self.settle_ns and not any(m.stated for m in [*known, *extra.values()]):
            now = self.clock_ns()
            # A member the watch has not delivered yet (the arriving pod, a listed one) is new now.
            newest = now if len(known) < len(keys) else max(m.seen_ns for m in known)
            settling = max(0, newest + self.settle_ns - now)
        return Progress(group, max(len(keys), wanted), len(done), len(keys), settling)

    def members(self, group: GroupKey) -> list[str]:
        return sorted(self._by_group.get(group, ()))

    def expire(self, now_ns: int) -> list[tuple[GroupKey, list[HeldMember]]]:
        """Groups whose first hold is ``timeout`` old: their held members, released here, and the
        group rests as long before it holds again."""
        out = []
        for group, holds in list(self._holds.items()):
            if now_ns - holds.since_ns >= self.timeout_ns:
                del self._holds[group]
                self._resting[group] = now_ns + self.timeout_ns
                out.append((group, sorted(holds.held.values(), key=lambda m: m.key)))
        for group, until in list(self._resting.items()):
            if until <= now_ns:
                del self._resting[group]
        return out
