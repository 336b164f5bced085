"""Filters for the cluster half of gpu_preflight: what the apiserver says about the cluster qgpu joins.

Two checks, each a result of the role's form (``check``, ``ok``, ``detail``) whose detail names the
way out:

- ``kubernetes_version``: the apiserver's version against the oldest one the objects the roles
  render need (``__gpu_preflight_kubernetes_from``, tests/provisioning/test_preflight_cluster.py
  derives it from the rendered manifests);
- ``device_plugin_conflict``: another device plugin serving ``nvidia.com/gpu`` on a node of qgpu's
  pools, which would hand the same cards out twice. Found from the API, two ways: a DaemonSet whose
  image is NVIDIA's k8s-device-plugin (standalone, Helm chart, or the GPU Operator's
  nvidia-device-plugin-daemonset) and which can reach kubelet's device-plugin socket (a hostPath
  volume, a privileged container or the host's PID namespace), with a pod on such a node; and a
  pool node the GPU Operator is told to run its device plugin on (label
  ``nvidia.com/gpu.deploy.device-plugin`` other than ``false``), whose pod may not be there yet.
  An image's name alone is not enough: a tenant may create a DaemonSet of any image name, and one
  without host access (what Pod Security ``baseline`` leaves a tenant) serves nothing, so it must
  not stop every run of the playbooks.

Pure functions of the API's answers (dicts), unit-tested in tests/provisioning/test_preflight_cluster.py.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from ansible.errors import AnsibleFilterError

# NVIDIA's device plugin images: nvcr.io/nvidia/k8s-device-plugin, docker.io/nvidia/k8s-device-plugin, ...
DEVICE_PLUGIN_IMAGE = re.compile(r"(^|/)k8s-device-plugin([:@]|$)")
OPERATOR_DEVICE_PLUGIN_LABEL = "nvidia.com/gpu.deploy.device-plugin"
QGPU_PART_OF = ("app.kubernetes.io/part-of", "qgpu")
SHOWN_NODES = 5


def _minor(version: str, what: str) -> tuple[int, int]:
    match = re.match(r"^v?(\d+)\.(\d+)", str(version).strip())
    if not match:
        raise AnsibleFilterError(f"{what}={version!r}: expected vMAJOR.MINOR[.PATCH], e.g. v1.31.2")
    return int(match.group(1)), int(match.group(2))


def kubernetes_version_result(server_version: str, minimum: str) -> dict[str, Any]:
    """The ``kubernetes_version`` result for the apiserver's ``gitVersion``."""
    have, need = _minor(server_version, "the apiserver's version"), _minor(minimum, "__gpu_preflight_kubernetes_from")
    if have >= need:
        return {"check": "kubernetes_version", "ok": True,
                "detail": f"kube-apiserver {server_version}; qgpu's objects need {minimum} or later"}
    return {"check": "kubernetes_version", "ok": False, "detail": (
        f"kube-apiserver {server_version} is older than {minimum}, the oldest release that serves what qgpu's roles "
        f"render: admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy (qgpu_webhook_admission_policy, "
        f"qgpu_scheduler_admission_policy, qgpu_manager_admission_policy) and webhook matchConditions (GA in 1.30). "
        f"Way out: upgrade the cluster to {minimum} or later; to install anyway, unsupported, leave kubernetes_version "
        f"out of gpu_preflight_checks")}


def _is_qgpu(obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(QGPU_PART_OF[0]) == QGPU_PART_OF[1]


def _reaches_the_host(pod_spec: Mapping[str, Any], containers: list[Mapping[str, Any]]) -> bool:
    """Whether a pod of this template could reach kubelet's device-plugin socket: a hostPath volume
    (the socket's folder, wherever kubelet's root is), a privileged container, or the host's PIDs
    (``/proc/1/root``)."""
    volumes = [v for v in pod_spec.get("volumes") or [] if isinstance(v, Mapping)]
    privileged = any(((c.get("securityContext") or {}).get("privileged")) is True for c in containers)
    return any("hostPath" in v for v in volumes) or privileged or pod_spec.get("hostPID") is True


def device_plugin_daemonsets(daemonsets: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The DaemonSets running NVIDIA's device plugin with access to the host (qgpu's own left
    out), each as ``namespace``, ``name`` and ``selector`` (its pods' matchLabels, for listing them)."""
    found = []
    for ds in daemonsets or []:
        if not isinstance(ds, Mapping) or _is_qgpu(ds):
            continue
        spec = ds.get("spec") or {}
        pod_spec = ((spec.get("template") or {}).get("spec")) or {}
        containers = [c for c in (pod_spec.get("containers") or []) + (pod_spec.get("initContainers") or [])
                      if isinstance(c, Mapping)]
        images = [str(c.get("image") or "") for c in containers]
        if any(DEVICE_PLUGIN_IMAGE.search(image) for image in images) and _reaches_the_host(pod_spec, containers):
            meta = ds.get("metadata") or {}
            labels = ((spec.get("selector") or {}).get("matchLabels")) or {}
            found.append({"namespace": meta.get("namespace", ""), "name": meta.get("name", ""),
                          "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items()))})
    return found


def _shown(nodes: Iterable[str]) -> str:
    nodes = sorted(set(nodes))
    more = f" and {len(nodes) - SHOWN_NODES} more" if len(nodes) > SHOWN_NODES else ""
    return ", ".join(nodes[:SHOWN_NODES]) + more


def device_plugin_conflict_result(plugins: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
                                  nodes: Iterable[Mapping[str, Any]], pool_nodes: Iterable[str]) -> dict[str, Any]:
    """The ``device_plugin_conflict`` result. ``plugins``: :func:`device_plugin_daemonsets`;
    ``pods``: their pods (any order; matched by owner); ``nodes``: the cluster's Nodes;
    ``pool_nodes``: the node names of qgpu's GPU pools."""
    pool = {str(n) for n in pool_nodes or []}
    plugin_names = {(p["namespace"], p["name"]) for p in plugins or []}
    running: dict[tuple[str, str], set[str]] = {}
    for pod in pods or []:
        meta = pod.get("metadata") or {}
        node = (pod.get("spec") or {}).get("nodeName")
        for owner in meta.get("ownerReferences") or []:
            key = (meta.get("namespace", ""), owner.get("name", ""))
            if owner.get("kind") == "DaemonSet" and key in plugin_names and node in pool:
                running.setdefault(key, set()).add(node)
    operator = sorted(n["metadata"]["name"] for n in nodes or [] if n.get("metadata", {}).get("name") in pool
                      and OPERATOR_DEVICE_PLUGIN_LABEL in (n["metadata"].get("labels") or {})
                      and n["metadata"]["labels"][OPERATOR_DEVICE_PLUGIN_LABEL] != "false")
    problems = [
        f"DaemonSet {ns}/{name} runs NVIDIA's device plugin on qgpu's nodes {_shown(on)}: both would serve nvidia.com/gpu "
        f"and hand the same cards out twice. Way out: delete it, or keep it off qgpu's pools (a nodeSelector or node "
        f"affinity excluding them); with the GPU Operator, label those nodes {OPERATOR_DEVICE_PLUGIN_LABEL}=false"
        for (ns, name), on in sorted(running.items())]
    if operator:
        problems.append(
            f"the GPU Operator is told to run its device plugin on qgpu's nodes {_shown(operator)} (label "
            f"{OPERATOR_DEVICE_PLUGIN_LABEL}). Way out: label them {OPERATOR_DEVICE_PLUGIN_LABEL}=false (the operator then "
            f"removes its device plugin there), or install the operator with devicePlugin.enabled=false")
    if problems:
        return {"check": "device_plugin_conflict", "ok": False, "detail": "; ".join(problems)}
    found = ", ".join(f"{p['namespace']}/{p['name']}" for p in plugins or [])
    return {"check": "device_plugin_conflict", "ok": True, "detail": (
        f"no other device plugin serves nvidia.com/gpu on qgpu's {len(pool)} pool nodes"
        + (f" (NVIDIA device plugin DaemonSets elsewhere: {found})" if found else ""))}


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "qgpu_kubernetes_version_result": kubernetes_version_result,
            "qgpu_device_plugin_daemonsets": device_plugin_daemonsets,
            "qgpu_device_plugin_conflict_result": device_plugin_conflict_result,
        }
