"""Pods as the API would return them, carrying a qgpu allocation record."""

from __future__ import annotations

import json
import uuid as uuidlib
from typing import Any

from tests.recordkeys import sign_pod


def pod(name: str, node: str, containers: list[tuple[str, dict[str, Any], list[tuple[int, str, int, int]]]], *,
        namespace: str = "default", bind_time: int | None = 1, klass: str = "normal", phase: str = "Pending",
        record_node: str | None = None, policy: str = "binpack", container_ids: dict[str, str] | None = None,
        signed: bool = True) -> dict:
    """containers: (name, limits, [(card index, card uuid, core_milli, memory_mib)]). The record is
    signed with the tests' extender key (tests/recordkeys.py) unless ``signed`` is False."""
    uid = str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"{namespace}/{name}"))
    record = {"version": 1, "node": record_node or node, "policy": policy, "class": klass, "time": "2026-11-23T09:30:00Z",
              "containers": [{"name": c, "cards": [{"index": i, "uuid": u, "core_milli": core, "memory_mib": mem}
                                                    for i, u, core, mem in cards]} for c, _, cards in containers if cards]}
    notes = {"qgpu.io/allocation": json.dumps(record)}
    if bind_time is not None:
        notes["qgpu.io/bind-time"] = str(bind_time)
    status: dict[str, Any] = {"phase": phase}
    if container_ids:
        status["containerStatuses"] = [{"name": c, "containerID": f"containerd://{cid}"} for c, cid in container_ids.items()]
    made = {
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "annotations": notes},
        "spec": {"nodeName": node, "containers": [{"name": c, "resources": {"limits": limits}} for c, limits, _ in containers]},
        "status": status,
    }
    return sign_pod(made) if signed else made


def qgpu(core: int, mem_gib: int) -> dict[str, Any]:
    return {"tke.cloud.tencent.com/qgpu-core": str(core), "tke.cloud.tencent.com/qgpu-memory": str(mem_gib)}


def write_pods(path, pods: list[dict]) -> None:
    path.write_text(json.dumps({"items": pods}))
