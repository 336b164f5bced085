"""What a prepared claim is in the node store: its rows, its devices as kubelet heard them, its pods.

The DRA plugin's checkpoint is the node store (node/store.py): a claim is booked as ``shares`` rows
keyed by its UID (the table the device plugin writes, so `qgpu status`, the metrics and the
isolation engine read one store) plus a ``PreparedClaim`` holding the devices kubelet was answered
and the pods of the claim's ``status.reservedFor``. A repeated prepare answers from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from qgpu_runtime.contract.draclaim import ClaimShare, ShareSettings
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.node.overbooking import card_use, over_booking
from qgpu_runtime.node.store import ReservedPod, Share


@dataclass(frozen=True)
class PreparedDevice:
    """One device of kubelet's answer (dra/v1 ``Device``)."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"requestNames": list(self.request_names), "pool": self.pool_name, "device": self.device_name,
                "cdiDeviceIDs": list(self.cdi_device_ids), "shareID": self.share_id}

    @classmethod
    def of_json(cls, doc: Mapping[str, Any]) -> PreparedDevice:
        return cls(tuple(doc["requestNames"]), str(doc["pool"]), str(doc["device"]), tuple(doc["cdiDeviceIDs"]),
                   str(doc.get("shareID") or ""))


def share_rows(namespace: str, name: str, uid: str, shares: Sequence[ClaimShare], settings: Mapping[str, ShareSettings],
               cards: Mapping[int, CardInfo], now: int) -> list[Share]:
    """One store row per result; the request name stands where a container's name would
    (`qgpu status` shows it), made unique when one request holds one card twice
    (``<request>[<i>]``, node/tenants.py reads the request back); the class is the request's
    opaque config's, as the device plugin records the pod's."""
    rows: list[Share] = []
    seen: set[tuple[str, int]] = set()
    for i, s in enumerate(shares):
        label = s.request if (s.request, s.card_index) not in seen else f"{s.request}[{i}]"
        seen.add((label, s.card_index))
        rows.append(Share(uid, namespace, name, label, s.card_index, cards[s.card_index].uuid, s.core_milli,
                          s.memory_mib, settings[s.request].app_class, now))
    return rows


def over_booked(cards: Mapping[int, CardInfo], where: str, uid: str, mine: Sequence[Share],
                others: Sequence[Share]) -> list[str]:
    """Why the claim's rows ``mine`` would over-book a card held by ``others`` (every other row of
    the store: the device plugin's, other claims'); the guard of node/overbooking.py, one use per
    card (a claim holding one card twice counts its sum)."""
    core: dict[int, int] = {}
    memory: dict[int, int] = {}
    for s in mine:
        core[s.card_index] = core.get(s.card_index, 0) + s.core_milli
        memory[s.card_index] = memory.get(s.card_index, 0) + s.memory_mib
    return over_booking(cards, others, f"claim/{uid}", where, [card_use(i, core[i], memory[i]) for i in sorted(core)])


def reserved_pods(claim: Mapping[str, Any]) -> tuple[ReservedPod, ...]:
    """The pods of the claim's ``status.reservedFor`` (entries of other resources are skipped):
    whose containers the isolation loop treats as the claim's tenant (node/tenants.py)."""
    out = []
    for entry in (claim.get("status") or {}).get("reservedFor") or []:
        if isinstance(entry, dict) and entry.get("resource") == "pods" and not entry.get("apiGroup") and entry.get("uid"):
            out.append(ReservedPod(str(entry["uid"]), str(entry.get("name") or "")))
    return tuple(out)
