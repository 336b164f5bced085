"""Every name two qgpu processes (or qgpu and the roles) must spell the same way.

Annotations and labels on pods, nodes and Leases, the taint of whole-card pools and the pod
phases the node and the extender compare against. The resource names of the request dialects
(``tke.cloud.tencent.com/qgpu-core`` …) are the pod's own vocabulary and live with their parser
in ``model/requests.py``. ``tests/contract/test_names_in_roles.py`` checks that the roles'
defaults and templates name nothing under these prefixes that this module does not know.
"""

from __future__ import annotations

from typing import Any, Final, Mapping

# --- pods: written by the extender at bind, read by the node manager and `qgpu status` -----------
# A tenant may write none of these (the roles' ValidatingAdmissionPolicy qgpu-pod-annotations).
ALLOCATION: Final = "qgpu.io/allocation"
"""The allocation record (contract/record.py, docs/annotations.md)."""
BIND_TIME: Final = "qgpu.io/bind-time"
"""Epoch nanoseconds of the bind; the device plugin serves pods in this order."""
ALLOCATION_SIGNATURE: Final = "qgpu.io/allocation-signature"
"""The extender's Ed25519 signature over pod UID, node, record and bind-time (contract/signature.py)."""
ASSIGNED: Final = "qgpu.io/assigned"
"""JSON list of container names the device plugin already served (written by the node manager)."""

# --- nodes: written by the node manager, read by the extender and `qgpu status` -----------------
INVENTORY: Final = "qgpu.io/gpus"
"""The card inventory (contract/inventory.py)."""
NODE_ISOLATION_POLICY: Final = "qgpu.io/isolation-policy"
"""The policy the node's manager enforces, as it read it at start."""
LABEL_GPU_COUNT: Final = "qgpu.io/gpu-count"
LABEL_GPU_MODEL: Final = "qgpu.io/gpu-model"
LABEL_GPU_MEMORY: Final = "qgpu.io/gpu-memory-mib"

# --- nodes: applied by the qgpu_node_pool role, read by the extender and the node manager ------
ISOLATION_POLICY_LABEL: Final = "tke.cloud.tencent.com/qgpu-schedule-policy"
"""qGPU's pool label naming the isolation policy (best-effort, fixed-share, burst-share)."""
MIXED_LABEL: Final = "mixed-qgpu-enable"
"""qGPU's online/offline co-location label (value ``enable``)."""
ALLOC_MODE_LABEL: Final = "sched.tensorstack.dev/node-alloc-mode"
"""T9k's allocation mode of a node: ``xgn`` (whole cards) or ``sgn`` (shared)."""
ACCELERATOR_LABEL: Final = "sched.tensorstack.dev/accelerator"
DEVICE_ENABLE_LABEL: Final = "qgpu-device-enable"
"""GPU nodes of a pool (value ``enable``); the node manager's DaemonSets select on it."""
XGN_TAINT_KEY: Final = "sched.tensorstack.dev/xgn-mode"
"""Taint of whole-card (xgn) nodes; the webhook adds its toleration to whole-card pods."""
POOL_MODE_LABEL: Final = "qgpu.io/pool-mode"
"""How the pool's cards reach pods: ``device-plugin`` (extended resources, the extender places) or
``dra`` (ResourceSlices, kube-scheduler allocates claims). The manager DaemonSets select on it."""
POOL_MODES: Final = ("device-plugin", "dra")
POOL_MODE_DRA: Final = "dra"  # of POOL_MODES: the pools whose cards are DRA devices

# --- Leases: written and read by every extender -------------------------------------------------
COMMITMENTS: Final = "qgpu.io/commitments"
"""Annotation of the node's Lease holding the binds in flight (placement/commitments.py)."""
COMMITMENTS_LEASE_PREFIX: Final = "qgpu-node."
BINDERS: Final = "qgpu.io/binders"
"""Annotation of the binders' Lease: which extenders bind now and whether each commits its binds
(extender/presence.py)."""
BINDERS_LEASE: Final = "qgpu-binders"
"""The one binders' Lease, next to the node commitments (not a node's: node Leases are ``qgpu-node.*``)."""

# --- Leases: written and read by every webhook replica -------------------------------------------
CLAIM_RESERVATIONS: Final = "qgpu.io/claim-reservations"
"""Annotation of a namespace's claim-quota ledger Lease: claims admitted but not yet visible
(webhook/ledger.py)."""
CLAIM_QUOTA_LEASE_PREFIX: Final = "qgpu-claim-quota."
"""``qgpu-claim-quota.<namespace>``: the ledger Leases, in the webhook's own namespace."""

# --- namespaces and workload objects the roles render ------------------------------------------
WEBHOOK_OPT_OUT_LABEL: Final = "qgpu.io/webhook"
"""Namespaces labelled ``qgpu.io/webhook=disabled`` are not sent to the webhook."""
GROUP_MIN_MEMBER: Final = "qgpu.io/group-min-member"
"""Pod annotation a user writes: the minimum size of the pod's T9k group, 1..64 (extender/groups.py)."""
GROUP_LABEL: Final = "scheduler.tensorstack.dev/group-name"
"""Pod label a user writes: T9k's group (gang) of the pod, by name within its namespace."""
MIRROR_POD: Final = "kubernetes.io/config.mirror"
"""Pod annotation the kubelet puts on the mirror pod of a static pod. NodeRestriction lets a node
create no other pod (bound to itself, in any namespace, with any labels and annotations); the
apiserver requires ``spec.nodeName`` with it at create and refuses adding, changing or removing it
later; and a kubelet runs such a pod only from a manifest on its own host, never as the apiserver
holds it. Kubernetes' own name: not checked against the roles."""
GPU_MODE: Final = "qgpu.io/gpu-mode"
"""Label of namespaces (and annotation of pods) choosing how GPU requests are served: ``dra``
namespaces are registered with the webhook's /mutate-dra, which turns every dialect into DRA claims;
a pod annotated ``device-plugin`` there keeps its resources (docs/dra.md)."""
GPU_MODE_DRA: Final = "dra"
GPU_MODE_DEVICE_PLUGIN: Final = "device-plugin"
POD_TEMPLATE_ANNOTATIONS: Final = frozenset({
    "qgpu.io/scheduler-config-checksum", "qgpu.io/admission-config-checksum", "qgpu.io/tls-checksum",
    "qgpu.io/tls-sha256", "qgpu.io/device-resources"})
"""Annotations only the roles write on their own objects, to roll pods when config changes. Two sit
on the masters' static pods (kube-scheduler's, kube-apiserver's), whose mirror pods the kubelet
creates: the pod-annotation policy must leave them open or it refuses those mirror pods."""
IMAGE_DIGEST: Final = "rollout.qgpu.io/image-digest"
"""The image's manifest digest on qgpu's own pod templates (cluster.yml takes it from the image it
built): a rebuilt image under the same reference rolls the pods. Outside the ``qgpu.io/`` prefix the
pod-annotation policy keeps for qgpu's state on pods: nothing reads it but the controllers."""
RETIRED_FROM: Final = frozenset({
    "qgpu.io/retired-scheduler-from", "qgpu.io/retired-webhook-from", "qgpu.io/retired-manager-from"})
"""Annotations the roles leave on qgpu's namespace once nothing of an earlier release is left in the
namespace it names (kube-system): the next runs skip that search (docs/provisioning.md)."""

# --- the Node's status: written by its manager, read by operators and the roles' admission policy ----
SHARES_ENFORCED_CONDITION: Final = "QGPUSharesEnforced"
"""Node condition: ``True`` when the node's manager enforces the cards' shares, ``False`` with the
reason when not (node/enforcer.py ``enforcement``). The only condition the manager may write."""

# --- the node manager's pods and metrics, as `qgpu status` finds and reads them -------------------
MANAGER_APP_LABEL: Final = "app.kubernetes.io/name"
MANAGER_APP: Final = "qgpu-manager"
"""Every node manager pod the roles render carries ``app.kubernetes.io/name: qgpu-manager``."""
MANAGER_NAMESPACE: Final = "qgpu-system"
"""The namespace the roles deploy the managers to unless told otherwise (``qgpu_namespace``)."""
METRICS_PORT_NAME: Final = "metrics"
"""The manager container's port serving Prometheus ``/metrics``."""
CONTAINER_CORE_USED: Final = "qgpu_container_core_used_ratio"
CONTAINER_MEMORY_USED: Final = "qgpu_container_memory_used_bytes"
CARD_UTILIZATION: Final = "qgpu_card_utilization_ratio"
CARD_MEMORY_USED: Final = "qgpu_card_memory_used_bytes"
"""The manager's series of what is used (node/metrics.py writes them, `qgpu status` reads them);
labels ``node``, ``card`` and, per container, ``namespace``, ``pod``, ``container``."""

# --- pod phases ---------------------------------------------------------------------------------
PENDING: Final = "Pending"
RUNNING: Final = "Running"
SUCCEEDED: Final = "Succeeded"
FAILED: Final = "Failed"
FINISHED_PHASES: Final = frozenset({SUCCEEDED, FAILED})
"""A pod in one of these phases holds no card any more."""


def phase(pod: dict) -> str:
    """A pod's phase as the API reports it; a pod without status is Pending (just created)."""
    return str((pod.get("status") or {}).get("phase") or PENDING)


def finished(pod: dict) -> bool:
    return phase(pod) in FINISHED_PHASES


def mirror_pod(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod`` carries :data:`MIRROR_POD`: a static pod's mirror, which a node creates bound
    to itself; anyone else's pod carrying it was created bound too, and no kubelet runs it."""
    meta = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
    annotations = meta.get("annotations") if isinstance(meta.get("annotations"), Mapping) else {}
    return MIRROR_POD in annotations


SHARED: Final = frozenset({
    ALLOCATION, BIND_TIME, ALLOCATION_SIGNATURE, ASSIGNED, INVENTORY, NODE_ISOLATION_POLICY, LABEL_GPU_COUNT, LABEL_GPU_MODEL,
    LABEL_GPU_MEMORY, ISOLATION_POLICY_LABEL, MIXED_LABEL, ALLOC_MODE_LABEL, ACCELERATOR_LABEL, DEVICE_ENABLE_LABEL, XGN_TAINT_KEY,
    POOL_MODE_LABEL, COMMITMENTS, BINDERS, CLAIM_RESERVATIONS, WEBHOOK_OPT_OUT_LABEL, GPU_MODE, GROUP_MIN_MEMBER,
    IMAGE_DIGEST, *POD_TEMPLATE_ANNOTATIONS, *RETIRED_FROM})
"""Every name above, for the check against the roles."""
