"""Every dialect on a DRA pool: a pod's GPU requests become ResourceClaimTemplates and claim references.

Pure: a pod (API dict) in, the templates it needs and the JSON patch out (docs/dra.md, "Every
dialect through the webhook"). The request is the model's own parser's, so a pod refused in
device-plugin mode is refused here with the same words, and a converted pod asks DRA for exactly
what the extender would have placed:

- a shared container (qGPU, vcuda below 100 %) → one request of ``SHARED_CLASS`` with
  ``capacity.requests`` ``core`` (thousandths of a card) and ``memory`` (MiB, rounded up to whole
  GiB as the slices' request policy does);
- whole cards (qGPU/vcuda multiples of 100, ``tensorstack.dev/nvidia-gpu``) → ``WHOLE_CLASS``,
  ``ExactCount`` with the card count, no capacity (the defaults are the whole card), and a
  ``distinctAttribute`` on the card UUID when several;
- ``tensorstack.dev/nvidia-gpu-node: 1`` → ``WHOLE_CLASS`` with ``allocationMode: All``;
- ``tensorstack.dev/nvidia-gpu-percent`` (memory depends on the card) → ``firstAvailable``: one
  subrequest per card size the pool has (``DraConfig.card_memory_mib``), each selecting that size;
- ``nvidia.com/gpu`` stays as it is: the whole-card DeviceClass maps it (KEP-5004); the pod gets
  the node selector ``qgpu.io/pool-mode: dra``, so no device-plugin node (where no claim is made,
  and nothing charges the cards) takes it.

GPU models (``qgpu.io/gpu-model``) become CEL selectors on the card's model: they filter, and the
scheduler must apply them. The qGPU class (online/offline) and greedy core become the request's
opaque configuration: the scheduler has no preference scoring to use them, the node does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from qgpu_runtime.contract import dra, draclaim
from qgpu_runtime.contract.inventory import MAX_MEMORY_MIB
from qgpu_runtime.contract.names import (
    ALLOC_MODE_LABEL,
    GPU_MODE,
    GPU_MODE_DEVICE_PLUGIN,
    GPU_MODE_DRA,
    MIXED_LABEL,
    POOL_MODE_LABEL,
)
from qgpu_runtime.contract.record import ContainerDialect
from qgpu_runtime.model.quantity import show_value
from qgpu_runtime.model.requests import (
    DEFAULT_LIMITS,
    GPU_RESOURCES,
    MIB_PER_GIB,
    NVIDIA_GPU,
    QGPU_PREFIX,
    AppClass,
    CardLimits,
    ContainerRequest,
    Dialect,
    PodRequest,
    RequestError,
    parse_pod,
    percent_share_memory_mib,
)
from qgpu_runtime.webhook.admission import REVIEW_VERSION, XGN_TOLERATION, ReviewError, WebhookConfig, _answer, _pod, _review, mutate

CLAIM_PREFIX = "qgpu-"
REQUEST_NAME = "gpu"
MANAGED_BY = {"app.kubernetes.io/managed-by": "qgpu-webhook"}
MAX_CARD_SIZES = 8  # firstAvailable takes at most 8 subrequests
XGN = "xgn"  # the T9k node label value of whole-card and whole-node nodes
POOL_MODE_DRA = "dra"  # the qgpu.io/pool-mode of DRA pools (contract/names.py POOL_MODES)


# What a percent-of-memory request was asked as, for the refusal's words.
PERCENT_ASKED = {Dialect.T9K: "tensorstack.dev/nvidia-gpu-percent", Dialect.HAMI: "nvidia.com/gpumem-percentage",
                 Dialect.KAI: "annotation gpu-fraction", Dialect.ELASTIC: "nano-gpu/gpu-percent"}


class DraRefusal(ValueError):
    """A valid request this webhook cannot express as a claim; the message says what is missing."""


class CardSizesUnavailable(RuntimeError):
    """The card sizes the pools publish cannot be read now (a 500: try again); names the call."""


@dataclass(frozen=True)
class DraConfig:
    """``card_memory_mib``: the card sizes (MiB, as the slices publish ``memoryMiB``) of the DRA
    pools, needed only for T9k percent-of-memory requests; when empty, ``published`` reads them
    from the pools' ResourceSlices (webhook/cardsizes.py)."""

    card_memory_mib: tuple[int, ...] = ()
    limits: CardLimits = DEFAULT_LIMITS
    published: Callable[[], tuple[int, ...]] | None = field(default=None, compare=False)

    def card_sizes(self) -> tuple[int, ...]:
        """The sizes percent claims choose among, smallest first (CardSizesUnavailable when the
        published ones cannot be read)."""
        if self.card_memory_mib or self.published is None:
            return tuple(sorted(set(self.card_memory_mib)))
        return tuple(sorted(set(self.published())))

    def __post_init__(self) -> None:
        sizes = self.card_memory_mib
        if any(not isinstance(s, int) or isinstance(s, bool) or not MIB_PER_GIB <= s <= MAX_MEMORY_MIB for s in sizes):
            raise ValueError(f"card memory sizes {sizes!r} are not allowed: each must be an integer >= {MIB_PER_GIB} (MiB) "
                             f"and at most {MAX_MEMORY_MIB} (a card of 1 TiB)")
        if len(set(sizes)) > MAX_CARD_SIZES:
            raise ValueError(f"card memory sizes {sizes!r} are not allowed: at most {MAX_CARD_SIZES} distinct sizes")


DEFAULT_DRA_CONFIG = DraConfig()


@dataclass(frozen=True)
class ClaimTemplate:
    """A ResourceClaimTemplate named after its shape: the same shape always gives the same name."""

    name: str
    claim_spec: dict[str, Any] = field(hash=False, compare=True)

    def manifest(self, namespace: str) -> dict[str, Any]:
        return {"apiVersion": dra.API_VERSION, "kind": "ResourceClaimTemplate",
                "metadata": {"name": self.name, "namespace": namespace, "labels": dict(MANAGED_BY)},
                "spec": {"spec": self.claim_spec}}


@dataclass(frozen=True)
class Conversion:
    """What admitting one pod takes: the templates to ensure in its namespace, and the patch."""

    templates: tuple[ClaimTemplate, ...]
    patch: list[dict[str, Any]]


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _ours(resource: str) -> bool:
    return resource in GPU_RESOURCES or resource.startswith(QGPU_PREFIX)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]


def _whole_gib(memory_mib: int) -> int:
    return -(-memory_mib // MIB_PER_GIB) * MIB_PER_GIB


def _share_memory(memory_mib: int, limits: CardLimits) -> int:
    """Memory of a share as the slice's request policy consumes it: whole GiB, at least the minimum."""
    return max(_whole_gib(memory_mib), limits.min_shared_memory_mib)


def _percent_memory(card_mib: int, pct: int, limits: CardLimits) -> int:
    """``pct`` of a card of ``card_mib``, as the engine computes it, within what the card's policy allows."""
    usable = max(card_mib - card_mib % MIB_PER_GIB, limits.min_shared_memory_mib)
    return min(_share_memory(percent_share_memory_mib(card_mib, pct), limits), usable)


def _capacity(core_milli: int, memory_mib: int) -> dict[str, Any]:
    # A share of no core (online, T9k percent) takes the smallest step: DRA has no zero request.
    return draclaim.capacity_requests(max(core_milli, dra.CORE_STEP), memory_mib)


def _template(container: ContainerRequest, pod: PodRequest, config: DraConfig) -> ClaimTemplate:
    selectors = [{"cel": {"expression": dra.model_selector(pod.models)}}] if pod.models else []
    if pod.model_patterns is not None:
        selectors.append({"cel": {"expression": dra.model_pattern_selector(pod.model_patterns.use, pod.model_patterns.nouse)}})
    constraints: list[dict[str, Any]] = []
    if container.whole_node:
        name = "qgpu-node"
        request: dict[str, Any] = {"name": REQUEST_NAME, "exactly": {"deviceClassName": dra.WHOLE_CLASS, "allocationMode": "All"}}
    elif container.exclusive:
        name = f"qgpu-whole-x{container.cards}"
        request = {"name": REQUEST_NAME, "exactly": {"deviceClassName": dra.WHOLE_CLASS, "allocationMode": "ExactCount",
                                                     "count": container.cards}}
        if container.cards > 1:
            constraints.append({"requests": [REQUEST_NAME], "distinctAttribute": f"{dra.DRIVER}/{dra.ATTR_UUID}"})
    elif container.memory_pct is not None:
        sizes = list(config.card_sizes())
        if not sizes:
            raise DraRefusal(f"container {container.name!r}: {PERCENT_ASKED[container.dialect]}: {container.memory_pct} % "
                             f"of a card's memory needs the card sizes of the DRA pools, and no ResourceSlice of "
                             f"driver {dra.DRIVER} publishes a card yet (or set qgpu webhook serve --dra-card-memory-mib)")
        name = f"qgpu-pct{container.memory_pct}-s{_digest(sizes)}"  # T9k's names as before; HAMi's and KAI's add:
        name += (f"-c{container.core_milli}" if container.core_milli else "") + (f"-x{container.cards}" if container.cards > 1 else "")
        request = {"name": REQUEST_NAME, "firstAvailable": [
            {"name": f"mib{size}", "deviceClassName": dra.SHARED_CLASS, "allocationMode": "ExactCount", "count": container.cards,
             "selectors": [{"cel": {"expression": dra.memory_selector(size)}}, *selectors],
             "capacity": _capacity(container.core_milli, _percent_memory(size, container.memory_pct, config.limits))}
            for size in sizes]}
        selectors = []  # already in every subrequest
    else:
        memory = _share_memory(container.memory_mib, config.limits)
        capacity = _capacity(container.core_milli, memory)
        name = f"qgpu-c{capacity['requests'][dra.CORE]}-m{memory}-x{container.cards}"
        request = {"name": REQUEST_NAME, "exactly": {"deviceClassName": dra.SHARED_CLASS, "allocationMode": "ExactCount",
                                                     "count": container.cards, "capacity": capacity}}
    if container.shared and container.cards > 1:  # one share on each of several distinct cards
        constraints.append({"requests": [REQUEST_NAME], "distinctAttribute": f"{dra.DRIVER}/{dra.ATTR_UUID}"})
    if selectors:
        request["exactly"]["selectors"] = selectors
        patterns = pod.model_patterns
        name += f"-g{_digest(sorted(pod.models or ()) if patterns is None else [sorted(pod.models or ()), patterns.use, patterns.nouse])}"
    spec: dict[str, Any] = {"devices": {"requests": [request]}}
    if constraints:
        spec["devices"]["constraints"] = constraints
    dialect = _peer_dialect(container)
    # A share that asks no core (T9k percent, HAMi's and KAI's memory-only shares) is booked by the
    # node with core 0, as on device-plugin pools, not with the smallest core step the claim must
    # ask (an online share's node books core 0 from its class already).
    memory_only = container.shared and not container.core_milli and pod.klass is not AppClass.ONLINE
    if pod.klass is not AppClass.NORMAL or dialect is not None or memory_only:
        spec["devices"]["config"] = [{"requests": [REQUEST_NAME], "opaque": {
            "driver": dra.DRIVER, "parameters": draclaim.share_config(pod.klass.value, greedy=pod.klass is AppClass.OFFLINE,
                                                                      dialect=dialect, memory_only=memory_only)}}]
        name += f"-{pod.klass.value}" if pod.klass is not AppClass.NORMAL else ""
        name += f"-{container.dialect.value}" if dialect is not None else "-mo" if memory_only else ""
    return ClaimTemplate(name, spec)


def _peer_dialect(container: ContainerRequest) -> ContainerDialect | None:
    """The dialect the node needs to set a peer's own variables from the claim (HAMi's limits, KAI's
    portion, T9k's whole node, whose mode the shares alone do not tell), as the record carries it
    on the device-plugin path; None for the dialects whose variables follow from the shares."""
    if container.dialect in (Dialect.HAMI, Dialect.KAI) or container.whole_node:
        return ContainerDialect.of_request(container)
    return None


def _fill(ops: list[dict[str, Any]], base: str, resources: Mapping[str, Any], keys: set[str]) -> None:
    """Copy ``keys`` between requests and limits where only one side has them (the apiserver
    insists on limits for extended resources and on requests == limits)."""
    for have, missing_name in (("limits", "requests"), ("requests", "limits")):
        source = resources.get(have) or {}
        other = resources.get(missing_name)
        fill = {k: v for k, v in source.items() if k in keys and k not in (other or {})}
        if not fill:
            continue
        if other is None:
            ops.append({"op": "add", "path": f"{base}/{missing_name}", "value": fill})
            resources = {**resources, missing_name: fill}
        else:
            ops.extend({"op": "add", "path": f"{base}/{missing_name}/{_escape(k)}", "value": v} for k, v in fill.items())


def device_plugin_pod(pod: Mapping[str, Any]) -> bool:
    """A pod that asked, by annotation, to keep its resources for a device plugin."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return annotations.get(GPU_MODE) == GPU_MODE_DEVICE_PLUGIN


def convert(pod: Mapping[str, Any], config: DraConfig = DEFAULT_DRA_CONFIG) -> Conversion:
    """The templates and the patch that put ``pod``'s GPU requests on DRA claims.

    Raises the parser's RequestError for an invalid request (every problem, today's words), and
    DraRefusal for a valid one no claim can express here. A pod asking no GPU gets an empty patch.
    """
    request = parse_pod(pod, config.limits)
    spec = pod.get("spec") or {}
    containers = [c for c in (spec.get("containers") or []) if isinstance(c, Mapping)]
    # parse_pod returns one request per container that asks a GPU (not a zero, and a KAI pod's
    # container by annotation), in spec order
    index = {str(c.get("name") or ""): i for i, c in enumerate(containers)}
    asking = [(index[wanted.name], containers[index[wanted.name]]) for wanted in request.containers]
    taken = {str(c.get("name")) for c in spec.get("resourceClaims") or [] if isinstance(c, Mapping)}
    templates: dict[str, ClaimTemplate] = {}
    ops: list[dict[str, Any]] = []
    claims: list[dict[str, Any]] = []
    for (i, container), wanted in zip(asking, request.containers):
        resources = container.get("resources") or {}
        base = f"/spec/containers/{i}/resources"
        if wanted.dialect is Dialect.NVIDIA:
            _fill(ops, base, resources, {NVIDIA_GPU})
            continue
        template = _template(wanted, request, config)
        if templates.get(template.name, template) != template:
            raise DraRefusal(f"ResourceClaimTemplate name {template.name!r} stands for two shapes")  # a digest collision
        templates[template.name] = template
        claim = f"{CLAIM_PREFIX}{i}"
        if claim in taken:
            raise DraRefusal(f"container {wanted.name!r}: spec.resourceClaims already has {claim!r}: "
                             "qgpu names the claim of container i qgpu-<i>")
        for section in ("limits", "requests"):
            for key in sorted(k for k in (resources.get(section) or {}) if _ours(k)):
                ops.append({"op": "remove", "path": f"{base}/{section}/{_escape(key)}"})
        if resources.get("claims"):
            ops.append({"op": "add", "path": f"{base}/claims/-", "value": {"name": claim}})
        else:
            ops.append({"op": "add", "path": f"{base}/claims", "value": [{"name": claim}]})
        claims.append({"name": claim, "resourceClaimTemplateName": template.name})
    if claims:
        if spec.get("resourceClaims"):
            ops.extend({"op": "add", "path": "/spec/resourceClaims/-", "value": c} for c in claims)
        else:
            ops.append({"op": "add", "path": "/spec/resourceClaims", "value": claims})
    selector = spec.get("nodeSelector") or {}
    pins: dict[str, str] = {}
    if request.klass is not AppClass.NORMAL and request.wants_gpu and MIXED_LABEL not in selector:
        # qGPU's online/offline pods only go to nodes labelled for co-location, as the extender requires.
        pins[MIXED_LABEL] = "enable"
    if request.whole_node:
        # T9k's nvidia-gpu-node holds a whole xgn node, as the extender places it on device-plugin pools.
        pins[ALLOC_MODE_LABEL] = XGN
    nvidia = next((c for c in request.containers if c.dialect is Dialect.NVIDIA), None)
    if nvidia is not None:
        # nvidia.com/gpu becomes kube-scheduler's own claim only on a node that does not advertise it,
        # and that claim is what the namespace's quota charges (webhook/podquota.py). On a device-plugin
        # node, which advertises it, no claim is made and the cards are charged nowhere: so the pod
        # goes to DRA pools only, as the namespace's label says.
        asked = selector.get(POOL_MODE_LABEL, POOL_MODE_DRA)
        if asked != POOL_MODE_DRA:
            raise DraRefusal(f"container {nvidia.name!r}: {NVIDIA_GPU} with spec.nodeSelector {POOL_MODE_LABEL}={show_value(asked)}: "
                             f"in a namespace labelled {GPU_MODE}={GPU_MODE_DRA}, {NVIDIA_GPU} is served by DRA pools "
                             f"({POOL_MODE_LABEL}={POOL_MODE_DRA}); annotate the pod {GPU_MODE}: {GPU_MODE_DEVICE_PLUGIN} "
                             "to keep it for a device plugin")
        pins[POOL_MODE_LABEL] = POOL_MODE_DRA
    pins = {k: v for k, v in pins.items() if selector.get(k) != v}
    if pins and not selector:
        ops.append({"op": "add", "path": "/spec/nodeSelector", "value": pins})
    else:
        ops.extend({"op": "add", "path": f"/spec/nodeSelector/{_escape(k)}", "value": v} for k, v in pins.items())
    if any(c.exclusive or c.whole_node for c in request.containers):
        tolerations = spec.get("tolerations")
        if not tolerations:
            ops.append({"op": "add", "path": "/spec/tolerations", "value": [XGN_TOLERATION]})
        elif not any(all(t.get(k) == v for k, v in XGN_TOLERATION.items()) for t in tolerations if isinstance(t, dict)):
            ops.append({"op": "add", "path": "/spec/tolerations/-", "value": XGN_TOLERATION})
    return Conversion(tuple(templates.values()), ops)


class TemplateError(RuntimeError):
    """The apiserver did not take a template; the message names it and carries the apiserver's reason."""


EnsureTemplates = Callable[[str, Sequence[ClaimTemplate]], None]


def _deny(uid: str, message: str, code: int) -> dict[str, Any]:
    return {"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview",
            "response": {"uid": uid, "allowed": False, "status": {"code": code, "reason": "Invalid" if code == 422 else "InternalError",
                                                                   "message": message}}}


def _check_claim_fields(pod: Mapping[str, Any]) -> None:
    """The JSON types of the fields only this mutation reads (check_pod covers the parser's): a 400
    naming the field, not a 500."""
    where = "AdmissionReview.request.object.spec"
    spec = pod.get("spec") or {}

    def objects(value: Any, path: str) -> None:
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, dict) for v in value)):
            raise ReviewError(f"{path}={show_value(value)}: must be a list of objects")

    objects(spec.get("resourceClaims"), f"{where}.resourceClaims")
    for i, container in enumerate(spec.get("containers") or []):
        objects((container.get("resources") or {}).get("claims"), f"{where}.containers[{i}].resources.claims")
    selector = spec.get("nodeSelector")
    if selector is not None and (not isinstance(selector, dict) or not all(isinstance(v, str) for v in selector.values())):
        raise ReviewError(f"{where}.nodeSelector={show_value(selector)}: must be an object of strings")


def mutate_dra(body: bytes | str, config: WebhookConfig, dra_config: DraConfig, ensure: EnsureTemplates) -> dict[str, Any]:
    """/mutate-dra: convert a pod being created (templates ensured first, none on dryRun) and deny
    what the parser refuses with its words. An UPDATE cannot add claims to a pod: it gets what
    /mutate gives, as does a pod annotated ``qgpu.io/gpu-mode: device-plugin``."""
    _, request = _review(body)
    if not isinstance(request.get("dryRun"), (bool, type(None))):
        raise ReviewError(f"AdmissionReview.request.dryRun={request['dryRun']!r}: must be a boolean")
    pod = _pod(request)
    if pod is None or request.get("operation") != "CREATE" or device_plugin_pod(pod):
        return mutate(body, config)
    _check_claim_fields(pod)
    uid = request["uid"]
    try:
        conversion = convert(pod, dra_config)
    except RequestError as exc:
        return _deny(uid, f"qgpu: {exc}", 422)
    except DraRefusal as exc:
        return _deny(uid, f"qgpu: {exc}", 422)
    except CardSizesUnavailable as exc:
        return _deny(uid, f"qgpu: the card sizes of the DRA pools cannot be read, so the pod is refused (try again): {exc}", 500)
    if conversion.templates and not request.get("dryRun"):
        try:
            ensure(pod["metadata"]["namespace"], conversion.templates)
        except TemplateError as exc:
            return _deny(uid, f"qgpu: {exc}", 500)
    return _answer(uid, True, patch=conversion.patch)
