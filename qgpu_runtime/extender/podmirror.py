"""The pods' API objects the extender keeps by UID, apart from their bookings.

- ``seen``: the pod filter last decided for, as the apiserver has it (extender/trust.py resolves
  the scheduler's body to it; bind gets only its name and UID); the most recent ``SEEN_PODS``;
- ``unbound``: every unbound live pod as the watch delivered it: the extender takes a pod's
  requests from there, not from the scheduler's request body (extender/trust.py);
- UID → pod key of the pods the watch delivered, and the UIDs of the last ``GONE_PODS`` pods
  deleted or finished (commitments are pruned by what is known of each UID).

Not thread-safe on its own: the cache's lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping

from qgpu_runtime.kube.podslim import kept

SEEN_PODS = 4096
GONE_PODS = 4096


class PodMirror:
    """Pods by UID: as filter saw them, unbound as the watch has them, their keys, and the gone."""

    def __init__(self) -> None:
        self._seen: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._unbound: dict[str, dict[str, Any]] = {}  # UID -> the pod as the apiserver has it
        self._uid_key: dict[str, str] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()

    def saw(self, uid: str, pod: Mapping[str, Any]) -> None:
        """Filter was sent this pod; the oldest beyond ``SEEN_PODS`` is forgotten."""
        self._seen[uid] = kept(pod)
        self._seen.move_to_end(uid)
        while len(self._seen) > SEEN_PODS:
            self._seen.popitem(last=False)

    def seen(self, uid: str) -> dict[str, Any] | None:
        return self._seen.get(uid)

    def drop_seen(self, uid: str) -> None:
        self._seen.pop(uid, None)

    def unbound(self, uid: str) -> dict[str, Any] | None:
        return self._unbound.get(uid)

    def set_unbound(self, uid: str, pod: Mapping[str, Any]) -> None:
        self._unbound[uid] = kept(pod)

    def drop_unbound(self, uid: str) -> None:
        self._unbound.pop(uid, None)

    def link(self, uid: str, key: str) -> None:
        self._uid_key[uid] = key

    def key_of(self, uid: str) -> str | None:
        return self._uid_key.get(uid)

    def forget(self, uid: str) -> None:
        """The pod with this UID is gone: its key is dropped and its UID remembered as gone."""
        if not uid:
            return
        self._uid_key.pop(uid, None)
        self._gone[uid] = None
        self._gone.move_to_end(uid)
        while len(self._gone) > GONE_PODS:
            self._gone.popitem(last=False)

    def gone(self, uid: str) -> bool:
        return uid in self._gone
