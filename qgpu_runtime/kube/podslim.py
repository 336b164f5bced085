"""What qgpu keeps of a pod it holds on to past one call.

The extender keeps every unbound pod and the pods kube-scheduler asked it about; a node manager
keeps every pod of its node. A pod's owner (a tenant with ``edit``) decides its size: one pod near
etcd's 1.5 MiB object limit, in tens of thousands of ``env`` entries, decodes to about 7 times its
JSON (0.9 MiB to 6.4 MiB, tests/kube/test_podslim.py), and a few dozen such pods, which ask no GPU and which nothing of qgpu judges, held whole, were enough
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


def _bulky(pod: Mapping[str, Any]) -> bool:
    meta, spec = pod.get("metadata"), pod.get("spec")
    if isinstance(meta, dict) and "managedFields" in meta:
        return True
    if not isinstance(spec, dict):
        return False
    if BULK_SPEC_FIELDS & spec.keys():
        return True
    return any(isinstance(c, dict) and BULK_CONTAINER_FIELDS & c.keys()
               for field in CONTAINER_LISTS if isinstance(spec.get(field), list) for c in spec[field])


def kept(pod: Mapping[str, Any]) -> dict[str, Any]:
    """``pod`` without the parts no qgpu component reads: a new dict, or ``pod`` itself when it
    has none of them (a pod kept already, compared again on every call). ``pod`` is never changed,
    and what is returned is not to be changed either."""
    if not _bulky(pod):
        return pod if isinstance(pod, dict) else dict(pod)
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
