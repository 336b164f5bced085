"""What qgpu keeps of a pod it holds on to past one call.

The extender keeps every unbound pod and the pods kube-scheduler asked it about; a node manager
keeps every pod of its node. A pod's owner (a tenant with ``edit``) decides its size: one pod near
etcd's 1.5 MiB object limit, in tens of thousands of ``env`` entries, decodes to about 10 MiB, and
a few dozen such pods, which ask no GPU and which nothing of qgpu judges, held whole, were enough
to run the extender (800 Mi) or a node manager (300 Mi) out of memory. :func:`kept` drops what no
qgpu component reads: each container's environment, command, arguments, mounts, probes and
lifecycle hooks, the pod's volumes and its ``managedFields``. Names, labels, annotations, resources,
node, scheduler, claims and status stay as they are.
"""

from __future__ import annotations

from typing import Any, Final, Mapping

BULK_CONTAINER_FIELDS: Final = frozenset({
    "env", "envFrom", "command", "args", "volumeMounts", "volumeDevices", "lifecycle",
    "livenessProbe", "readinessProbe", "startupProbe",
})
BULK_SPEC_FIELDS: Final = frozenset({"volumes"})
CONTAINER_LISTS: Final = ("containers", "initContainers", "ephemeralContainers")


def _container(container: Any) -> Any:
    if not isinstance(container, dict) or not BULK_CONTAINER_FIELDS & container.keys():
        return container
    return {k: v for k, v in container.items() if k not in BULK_CONTAINER_FIELDS}


def kept(pod: Mapping[str, Any]) -> dict[str, Any]:
    """``pod`` without the parts no qgpu component reads (a new dict; ``pod`` is not changed)."""
    out = dict(pod)
    meta = pod.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        out["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    spec = pod.get("spec")
    if isinstance(spec, dict):
        slim = {k: v for k, v in spec.items() if k not in BULK_SPEC_FIELDS}
        for field in CONTAINER_LISTS:
            if isinstance(spec.get(field), list):
                slim[field] = [_container(c) for c in spec[field]]
        out["spec"] = slim
    return out
