"""Canonical GPU requests, and the parser that turns a pod of any supported dialect into them.

Every caller that holds a pod (webhook, extender, `qgpu validate`, `qgpu run`) goes through
:func:`parse_pod`, so a rule is written once and an error reads the same wherever it is raised.
Two callers hold no pod and build no second parser: the simulator makes :class:`PodRequest` values
straight from trace rows, which are canonical already (sim/trace.py); the device plugin takes each
container's shares from the allocation record, which the extender derived from ``parse_pod``, and
only checks kubelet's device count against one resource quantity (node/deviceplugin/matching.py).
The module is pure: it reads dicts shaped like the Kubernetes API's JSON and raises
:class:`RequestError`; it never talks to a cluster.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Iterable, Mapping

from qgpu_runtime.model.quantity import QuantityError, parse_quantity, show_value

CORE_MILLI_PER_CARD = 1000
MIB_PER_GIB = 1024
VCUDA_MEMORY_UNIT_MIB = 256

QGPU_PREFIX = "tke.cloud.tencent.com/qgpu-"
QGPU_CORE = "tke.cloud.tencent.com/qgpu-core"
QGPU_MEMORY = "tke.cloud.tencent.com/qgpu-memory"
QGPU_CORE_GREEDY = "tke.cloud.tencent.com/qgpu-core-greedy"
QGPU_APP_CLASS = "tke.cloud.tencent.com/app-class"
VCUDA_CORE = "tencent.com/vcuda-core"
VCUDA_MEMORY = "tencent.com/vcuda-memory"
T9K_GPU = "tensorstack.dev/nvidia-gpu"
T9K_GPU_PERCENT = "tensorstack.dev/nvidia-gpu-percent"
T9K_GPU_NODE = "tensorstack.dev/nvidia-gpu-node"
NVIDIA_GPU = "nvidia.com/gpu"
HAMI_GPUMEM = "nvidia.com/gpumem"
HAMI_GPUMEM_PCT = "nvidia.com/gpumem-percentage"
HAMI_GPUCORES = "nvidia.com/gpucores"
HAMI_USE_GPUTYPE = "nvidia.com/use-gputype"
HAMI_NOUSE_GPUTYPE = "nvidia.com/nouse-gputype"
# nano-gpu and its successor, elastic GPU (elastic-ai/elastic-gpu-scheduler): one percent of a card,
# then core (percent, 100 a card) and memory (GiB, as qGPU's, which elastic GPU adds them to).
NANO_PERCENT = "nano-gpu/gpu-percent"
NANO_CORE = "nano-gpu.io/gpu-core"
NANO_MEMORY = "nano-gpu.io/gpu-memory"
EGPU_CORE = "elasticgpu.io/gpu-core"
EGPU_MEMORY = "elasticgpu.io/gpu-memory"
GPU_MODEL_ANNOTATION = "qgpu.io/gpu-model"

MAX_MODEL_NAMES = 16
"""GPU model names one annotation may list (``qgpu.io/gpu-model``, and each of HAMi's
``nvidia.com/use-gputype`` and ``nouse-gputype``). A cluster has a handful of GPU models, and
NVIDIA's data-centre cards since Kepler (K80 to B200) are about twenty; a pod that would take more
than 16 of them takes any card: leave the annotation out. Bounded because what the parser returns is
kept: the extender remembers each parsed pod (extender/memo.py), and on DRA pools the webhook
writes every name into a CEL selector, which the apiserver caps at 10 KiB (16 + 16 of HAMi's names at
the length bound below take about 5 KiB). Unbounded, 255 KiB of names (``0|1|2|…``, within the
apiserver's annotation limit) parsed to tens of thousands of strings, about 3.2 MiB a pod."""
MAX_MODEL_NAME_CHARS = 96
"""One name's length: NVML's own buffer for a card's name is 96 bytes
(NVML_DEVICE_NAME_V2_BUFFER_SIZE), the bound the node inventory holds ``model`` to
(contract/inventory.py ``MAX_ID_CHARS``), so a longer name matches no card, neither exactly
(``qgpu.io/gpu-model``) nor as a substring (HAMi's)."""

# KAI-Scheduler / Run:ai: pod annotations, read only on pods that name KAI's scheduler.
KAI_SCHEDULER = "kai-scheduler"
KAI_FRACTION = "gpu-fraction"
KAI_MEMORY = "gpu-memory"
KAI_NUM_DEVICES = "gpu-fraction-num-devices"
KAI_CONTAINER = "gpu-fraction-container-name"
KAI_ANNOTATIONS = (KAI_FRACTION, KAI_MEMORY, KAI_NUM_DEVICES, KAI_CONTAINER)

REQUEST_ANNOTATIONS = (QGPU_APP_CLASS, GPU_MODEL_ANNOTATION, HAMI_USE_GPUTYPE, HAMI_NOUSE_GPUTYPE, *KAI_ANNOTATIONS)
"""Every pod annotation :func:`parse_pod` reads, and so every one a pod's placement and quota charge
depend on besides its spec. The webhook charges a namespace's existing pods from what they carry
now (webhook/podquota.py), so these are fixed once a pod exists: the qgpu_scheduler role's admission
policy ``qgpu-pod-request-annotations`` refuses any change to them after CREATE
(tests/contract/test_names_in_roles.py holds the role's list to this one)."""

QGPU_RESOURCES = frozenset({QGPU_CORE, QGPU_MEMORY, QGPU_CORE_GREEDY})


class Dialect(str, enum.Enum):
    """Which product's resource names a container speaks."""

    QGPU = "qgpu"
    VCUDA = "vcuda"
    T9K = "t9k"
    NVIDIA = "nvidia"
    HAMI = "hami"
    KAI = "kai"
    ELASTIC = "elasticgpu"  # nano-gpu and elastic GPU


class AppClass(str, enum.Enum):
    """qGPU co-location class of a pod (annotation ``tke.cloud.tencent.com/app-class``)."""

    ONLINE = "online"
    OFFLINE = "offline"
    NORMAL = "normal"


DIALECT_OF_RESOURCE: dict[str, Dialect] = {
    QGPU_CORE: Dialect.QGPU,
    QGPU_MEMORY: Dialect.QGPU,
    QGPU_CORE_GREEDY: Dialect.QGPU,
    VCUDA_CORE: Dialect.VCUDA,
    VCUDA_MEMORY: Dialect.VCUDA,
    T9K_GPU: Dialect.T9K,
    T9K_GPU_PERCENT: Dialect.T9K,
    T9K_GPU_NODE: Dialect.T9K,
    NVIDIA_GPU: Dialect.NVIDIA,
    HAMI_GPUMEM: Dialect.HAMI,
    HAMI_GPUMEM_PCT: Dialect.HAMI,
    HAMI_GPUCORES: Dialect.HAMI,
    NANO_PERCENT: Dialect.ELASTIC,
    NANO_CORE: Dialect.ELASTIC,
    NANO_MEMORY: Dialect.ELASTIC,
    EGPU_CORE: Dialect.ELASTIC,
    EGPU_MEMORY: Dialect.ELASTIC,
}
GPU_RESOURCES = frozenset(DIALECT_OF_RESOURCE)


def asks_gpu_resource(container: Mapping[str, Any]) -> bool:
    """Whether a container lists a GPU resource of any dialect (or of the qGPU prefix) in its
    limits or requests, read without the parser's rules: its resources are fixed once the pod
    exists, whatever else in the pod breaks a parse."""
    resources = container.get("resources") if isinstance(container.get("resources"), Mapping) else {}
    for side in ("limits", "requests"):
        values = resources.get(side)
        if isinstance(values, Mapping) and any(k in GPU_RESOURCES or str(k).startswith(QGPU_PREFIX) for k in values):
            return True
    return False
HAMI_RESOURCES = frozenset({HAMI_GPUMEM, HAMI_GPUMEM_PCT, HAMI_GPUCORES})


@dataclass(frozen=True)
class CardLimits:
    """Limits a shared card imposes, from the qGPU product; both configurable per cluster.

    ``gib_per_shared_pod`` sets the pod-count limit: a card with M GiB takes at most
    floor(M / gib_per_shared_pod) shared containers (32 GiB V100: 8, 16 GiB T4: 4).
    ``max_card_memory_mib`` and ``max_cards_per_node`` bound what any card or node could ever hold,
    so an impossible request is refused at admission rather than pending forever.
    """

    gib_per_shared_pod: int = 4
    min_shared_memory_mib: int = 1 * MIB_PER_GIB
    max_card_memory_mib: int = 80 * MIB_PER_GIB
    max_cards_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("gib_per_shared_pod", "min_shared_memory_mib", "max_card_memory_mib", "max_cards_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CardLimits.{name}: {value!r} is not allowed: must be an integer >= 1")

    def shared_pods_per_card(self, card_memory_mib: int) -> int:
        """How many shared containers a card of this memory size may hold (at least one)."""
        return max(1, card_memory_mib // (self.gib_per_shared_pod * MIB_PER_GIB))


DEFAULT_LIMITS = CardLimits()


@dataclass(frozen=True)
class Problem:
    """One broken rule: where it is, what was given, and what the rule says."""

    container: str
    resource: str
    value: str
    rule: str

    def __str__(self) -> str:
        where = f"container {self.container!r}" if self.container else "pod"
        return f"{where}: {self.resource}={self.value}: {self.rule}"


class RequestError(ValueError):
    """A pod's GPU requests break one or more rules; ``problems`` lists every one of them."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__("; ".join(str(p) for p in self.problems))


@dataclass(frozen=True)
class ContainerRequest:
    """What one container needs, in canonical units.

    ``core_milli`` and ``memory_mib`` are per card. ``core_milli`` 1000 means a whole card;
    ``memory_mib`` 0 means no memory reservation (whole cards carry their full memory).
    ``memory_pct`` is set for percent-of-memory requests (T9k, HAMi, KAI, nano-gpu), whose memory
    depends on the card chosen.
    """

    name: str
    dialect: Dialect
    cards: int
    core_milli: int
    memory_mib: int = 0
    memory_pct: int | None = None
    exclusive: bool = False
    whole_node: bool = False

    @property
    def shared(self) -> bool:
        return not self.exclusive and not self.whole_node


def percent_share_memory_mib(card_memory_mib: int, pct: int) -> int:
    """MiB a share of ``pct`` % of a card's memory comes to on a card of ``card_memory_mib`` MiB,
    rounded up to a whole MiB. The one rule for percent-of-memory shares (``memory_pct``): the
    placement engine books it (``placement.engine.card_memory_need``, elementwise over a numpy array
    of card sizes) and the node bounds a record's grant by it (node/deviceplugin/recordcheck.py)."""
    return -(-card_memory_mib * pct // 100)


@dataclass(frozen=True)
class ModelPatterns:
    """HAMi's ``nvidia.com/use-gputype`` / ``nouse-gputype``: a card qualifies when its model
    contains one of ``use`` (when any is given) and none of ``nouse``, ignoring case, as HAMi
    compares them. Patterns are stored upper-cased."""

    use: tuple[str, ...] = ()
    nouse: tuple[str, ...] = ()

    def accepts(self, model: str) -> bool:
        name = model.upper()
        if self.use and not any(p in name for p in self.use):
            return False
        return not any(p in name for p in self.nouse)


@dataclass(frozen=True)
class PodRequest:
    """A pod's GPU needs: its containers' requests plus the pod-level constraints."""

    namespace: str
    name: str
    uid: str = ""
    klass: AppClass = AppClass.NORMAL
    containers: tuple[ContainerRequest, ...] = ()
    models: frozenset[str] | None = None
    alloc_mode: str | None = None
    model_patterns: ModelPatterns | None = None
    cpu_milli: int = 0
    memory_mib: int = 0

    @property
    def wants_gpu(self) -> bool:
        return bool(self.containers)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def whole_node(self) -> bool:
        return any(c.whole_node for c in self.containers)


def _resources(container: Mapping[str, Any], section: str) -> dict[str, Any]:
    resources = container.get("resources") or {}
    values = resources.get(section) or {}
    return dict(values) if isinstance(values, Mapping) else {}


class _Collector:
    """Gathers problems so a user sees every mistake of a pod at once, not one per attempt."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, container: str, resource: str, value: Any, rule: str) -> None:
        self.problems.append(Problem(container, resource, show_value(value), rule))


def _integer(c: _Collector, container: str, resource: str, raw: Any, rule: str, minimum: int = 1) -> int | None:
    """An integer quantity of at least ``minimum`` (1, positive, or 0), or None after recording
    why it is not one."""
    try:
        number = parse_quantity(raw)
    except QuantityError as exc:
        c.add(container, resource, raw, f"{exc.rule}; {rule}")
        return None
    if number < 0 or (minimum and number == 0):
        c.add(container, resource, raw, f"{'must be positive' if minimum else 'must not be negative'}; {rule}")
        return None
    if number != number.to_integral_value():
        c.add(container, resource, raw, f"fractions are not allowed; {rule}")
        return None
    return int(number)


_WHOLE = "must be a positive integer"


def _whole_cards(c: _Collector, container: str, resource: str, raw: Any, cards: int, limits: CardLimits) -> int | None:
    """``cards`` whole cards, unless no node could ever hold that many."""
    if cards > limits.max_cards_per_node:
        c.add(container, resource, raw, f"no node could ever hold it: at most {limits.max_cards_per_node} cards per node")
        return None
    return cards


def _one_card_percent(c: _Collector, container: str, resource: str, raw: Any, rule: str, over: str) -> int | None:
    """A percent of one card, 1..100: ``rule`` says what the value is, ``over`` why not above 100."""
    value = _integer(c, container, resource, raw, rule)
    if value is not None and value > 100:
        c.add(container, resource, raw, over)
        return None
    return value


def _core_cards(
    c: _Collector, container: str, resource: str, raw: Any, unit_name: str, limits: CardLimits
) -> tuple[int, int, bool] | None:
    """Percent-of-a-card core values: 1..99 share one card, multiples of 100 are whole cards."""
    value = _integer(c, container, resource, raw, f"{unit_name} is percent of one card: 1-99, or a multiple of 100")
    if value is None:
        return None
    if value < 100:
        return 1, value * 10, False
    if value % 100:
        c.add(container, resource, raw, "100 or more must be a multiple of 100 (whole cards)")
        return None
    cards = _whole_cards(c, container, resource, raw, value // 100, limits)
    return None if cards is None else (cards, CORE_MILLI_PER_CARD, True)


def _parse_container(
    c: _Collector,
    container: Mapping[str, Any],
    klass: AppClass,
    limits: CardLimits,
) -> ContainerRequest | None:
    name = str(container.get("name") or "")
    lim = _resources(container, "limits")
    req = _resources(container, "requests")
    ours = {k for k in set(lim) | set(req) if k in GPU_RESOURCES or k.startswith(QGPU_PREFIX)}
    if not ours:
        return None
    for key in sorted(ours):
        if key.startswith(QGPU_PREFIX) and key not in QGPU_RESOURCES:
            c.add(name, key, lim.get(key, req.get(key)), f"unknown qGPU resource; known: {', '.join(sorted(QGPU_RESOURCES))}")
    known = sorted(k for k in ours if k in GPU_RESOURCES)
    values: dict[str, Any] = {}
    before = len(c.problems)
    for key in known:
        if key in lim and key in req and _same_quantity(lim[key], req[key]) is False:
            c.add(name, key, f"requests {show_value(req[key])} / limits {show_value(lim[key])}", "requests must equal limits for GPU resources")
        values[key] = lim.get(key, req.get(key))
    if len(c.problems) != before:
        return None
    groups: dict[Dialect, list[str]] = {}
    hami = any(DIALECT_OF_RESOURCE[k] is Dialect.HAMI for k in known)
    for key in known:  # beside gpumem/gpucores, nvidia.com/gpu counts HAMi's vGPUs
        groups.setdefault(Dialect.HAMI if hami and key == NVIDIA_GPU else DIALECT_OF_RESOURCE[key], []).append(key)
    # Zero means no GPU from that dialect, as the apiserver and the peers read it: a dialect whose
    # every value is 0 asks nothing; a zero beside a non-zero of its own dialect is that dialect's to judge.
    asked = {d: keys for d, keys in groups.items() if not all(is_zero(values[k]) for k in keys)}
    if len(asked) > 1:
        keys = sorted(k for ks in asked.values() for k in ks)
        c.add(name, ",".join(keys), "mixed", f"one container may use one dialect only, found {', '.join(sorted(d.value for d in asked))}")
        return None
    if not asked:
        return None
    ((dialect, keys),) = asked.items()
    values = {k: values[k] for k in keys}
    parser = _DIALECT_PARSERS[dialect]
    return parser(c, name, values, klass, limits)


def is_zero(raw: Any) -> bool:
    """A quantity that reads as exactly 0 ("0", 0, "0m", "0Gi"); unreadable values are not zero
    (the value checks report them)."""
    try:
        return parse_quantity(raw) == 0
    except QuantityError:
        return False


def _same_quantity(a: Any, b: Any) -> bool | None:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except QuantityError:
        return None  # the value check reports it


def _card_memory(c: _Collector, name: str, resource: str, v: dict[str, Any], unit_mib: int, rule: str,
                 limits: CardLimits) -> int | None:
    """GPU memory per card in MiB from a count of ``unit_mib`` units: 0 when not asked for, None
    after recording why the value is unusable (not a positive integer, or larger than any card)."""
    if resource not in v:
        return 0
    units = _integer(c, name, resource, v[resource], rule)
    if units is None:
        return None
    memory_mib = units * unit_mib
    if memory_mib > limits.max_card_memory_mib:
        largest = limits.max_card_memory_mib
        shown = f"{largest // MIB_PER_GIB} GiB" if largest % MIB_PER_GIB == 0 else f"{largest} MiB"
        c.add(name, resource, v[resource], f"no card could ever hold it: the largest card has {shown}")
        return None
    return memory_mib


def _parse_qgpu(c: _Collector, name: str, v: dict[str, Any], klass: AppClass, limits: CardLimits) -> ContainerRequest | None:
    memory_mib = _card_memory(c, name, QGPU_MEMORY, v, MIB_PER_GIB, "qgpu-memory is whole GiB, an integer >= 1", limits)
    if memory_mib is None:
        return None
    if klass is AppClass.ONLINE:
        for key in (QGPU_CORE, QGPU_CORE_GREEDY):
            if key in v:
                c.add(name, key, v[key], "online pods request memory only (tke.cloud.tencent.com/qgpu-memory)")
                return None
        if not memory_mib:
            c.add(name, QGPU_MEMORY, "missing", "online pods must request tke.cloud.tencent.com/qgpu-memory")
            return None
        return ContainerRequest(name, Dialect.QGPU, cards=1, core_milli=0, memory_mib=memory_mib)
    if klass is AppClass.OFFLINE:
        if QGPU_CORE in v:
            c.add(name, QGPU_CORE, v[QGPU_CORE], "offline pods request tke.cloud.tencent.com/qgpu-core-greedy, not qgpu-core")
            return None
        if QGPU_CORE_GREEDY not in v:
            c.add(name, QGPU_CORE_GREEDY, "missing", "offline pods must request tke.cloud.tencent.com/qgpu-core-greedy (1-100)")
            return None
        greedy = _one_card_percent(c, name, QGPU_CORE_GREEDY, v[QGPU_CORE_GREEDY], "qgpu-core-greedy is percent of one card, 1-100",
                                   "offline pods may not span cards: at most 100 (one card)")
        if greedy is None:
            return None
        if not memory_mib:
            c.add(name, QGPU_MEMORY, "missing", "offline pods must request tke.cloud.tencent.com/qgpu-memory")
            return None
        return ContainerRequest(name, Dialect.QGPU, cards=1, core_milli=greedy * 10, memory_mib=memory_mib)
    if QGPU_CORE_GREEDY in v:
        c.add(name, QGPU_CORE_GREEDY, v[QGPU_CORE_GREEDY], f"only offline pods (annotation {QGPU_APP_CLASS}: offline) may request it")
        return None
    if QGPU_CORE not in v:
        c.add(name, QGPU_CORE, "missing", "tke.cloud.tencent.com/qgpu-memory needs tke.cloud.tencent.com/qgpu-core unless the pod is online")
        return None
    shape = _core_cards(c, name, QGPU_CORE, v[QGPU_CORE], "qgpu-core", limits)
    if shape is None:
        return None
    cards, core_milli, exclusive = shape
    if not exclusive:
        if not memory_mib:
            c.add(name, QGPU_MEMORY, "missing", "a shared qgpu-core (below 100) needs tke.cloud.tencent.com/qgpu-memory")
            return None
        if memory_mib < limits.min_shared_memory_mib:
            c.add(name, QGPU_MEMORY, v[QGPU_MEMORY], f"a shared card needs at least {limits.min_shared_memory_mib} MiB per container")
            return None
    return ContainerRequest(name, Dialect.QGPU, cards=cards, core_milli=core_milli, memory_mib=memory_mib, exclusive=exclusive)


def _parse_vcuda(c: _Collector, name: str, v: dict[str, Any], klass: AppClass, limits: CardLimits) -> ContainerRequest | None:
    memory_mib = _card_memory(c, name, VCUDA_MEMORY, v, VCUDA_MEMORY_UNIT_MIB, "vcuda-memory counts units of 256 MiB", limits)
    if memory_mib is None:
        return None
    if VCUDA_CORE not in v:
        c.add(name, VCUDA_CORE, "missing", "tencent.com/vcuda-memory needs tencent.com/vcuda-core")
        return None
    shape = _core_cards(c, name, VCUDA_CORE, v[VCUDA_CORE], "vcuda-core", limits)
    if shape is None:
        return None
    cards, core_milli, exclusive = shape
    if not exclusive and not memory_mib:
        c.add(name, VCUDA_MEMORY, "missing", "a shared vcuda-core (below 100) needs tencent.com/vcuda-memory")
        return None
    return ContainerRequest(name, Dialect.VCUDA, cards=cards, core_milli=core_milli, memory_mib=memory_mib, exclusive=exclusive)


def _parse_t9k(c: _Collector, name: str, v: dict[str, Any], klass: AppClass, limits: CardLimits) -> ContainerRequest | None:
    if len(v) > 1:
        c.add(name, ",".join(sorted(v)), "mixed", "a container asks for one of nvidia-gpu, nvidia-gpu-percent or nvidia-gpu-node")
        return None
    ((key, raw),) = v.items()
    if key == T9K_GPU:
        cards = _integer(c, name, key, raw, "nvidia-gpu counts whole cards")
        cards = None if cards is None else _whole_cards(c, name, key, raw, cards, limits)
        if cards is None:
            return None
        return ContainerRequest(name, Dialect.T9K, cards=cards, core_milli=CORE_MILLI_PER_CARD, exclusive=True)
    if key == T9K_GPU_PERCENT:
        pct = _one_card_percent(c, name, key, raw, "nvidia-gpu-percent is percent of one card's memory, 1-100",
                                "percent of one card's memory: at most 100")
        if pct is None:
            return None
        return ContainerRequest(name, Dialect.T9K, cards=1, core_milli=0, memory_pct=pct)
    count = _integer(c, name, key, raw, "nvidia-gpu-node must be 1")
    if count is None:
        return None
    if count != 1:
        c.add(name, key, raw, "nvidia-gpu-node must be 1 (the whole node)")
        return None
    return ContainerRequest(name, Dialect.T9K, cards=0, core_milli=CORE_MILLI_PER_CARD, exclusive=True, whole_node=True)


def _parse_nvidia(c: _Collector, name: str, v: dict[str, Any], klass: AppClass, limits: CardLimits) -> ContainerRequest | None:
    cards = _integer(c, name, NVIDIA_GPU, v[NVIDIA_GPU], "nvidia.com/gpu counts whole cards")
    cards = None if cards is None else _whole_cards(c, name, NVIDIA_GPU, v[NVIDIA_GPU], cards, limits)
    if cards is None:
        return None
    return ContainerRequest(name, Dialect.NVIDIA, cards=cards, core_milli=CORE_MILLI_PER_CARD, exclusive=True)


def _hami_percent(c: _Collector, name: str, resource: str, v: dict[str, Any], rule: str) -> int | None:
    """A HAMi percent (0-100; 0 reads as not given, as HAMi reads it); -1 after recording a problem."""
    if resource not in v:
        return None
    value = _integer(c, name, resource, v[resource], rule, minimum=0)
    if value is None:
        return -1
    if value > 100:
        c.add(name, resource, v[resource], f"at most 100; {rule}")
        return -1
    return value or None


def _parse_hami(c: _Collector, name: str, v: dict[str, Any], klass: AppClass, limits: CardLimits) -> ContainerRequest | None:
    """HAMi's vGPUs: ``nvidia.com/gpu`` N shares on N distinct cards (1 when only gpumem or gpucores
    is given: HAMi's ``defaultGPUNum``), each of ``gpumem`` MiB or ``gpumem-percentage`` % of the
    card's memory (neither: the whole memory, HAMi's ``defaultMemory: 0``) and ``gpucores`` % of its
    compute (absent: 100 when the memory is the whole card, else 0, HAMi's ``defaultCores: 0``).
    A vGPU of the whole memory or of all the compute is a whole card here."""
    cards = 1
    if NVIDIA_GPU in v:
        if is_zero(v[NVIDIA_GPU]):
            return None  # HAMi: no vGPU asked, whatever memory or cores the container names
        cards = _integer(c, name, NVIDIA_GPU, v[NVIDIA_GPU], "nvidia.com/gpu counts vGPUs, each on its own card")
        cards = None if cards is None else _whole_cards(c, name, NVIDIA_GPU, v[NVIDIA_GPU], cards, limits)
    memory_mib = 0
    if HAMI_GPUMEM in v:
        rule = "nvidia.com/gpumem is MiB of one card's memory, an integer (0: not given)"
        mem = _integer(c, name, HAMI_GPUMEM, v[HAMI_GPUMEM], rule, minimum=0)
        if mem is not None and mem > limits.max_card_memory_mib:
            c.add(name, HAMI_GPUMEM, v[HAMI_GPUMEM], f"no card could ever hold it: the largest card has {limits.max_card_memory_mib} MiB")
            mem = None
        memory_mib = -1 if mem is None else mem
    pct = _hami_percent(c, name, HAMI_GPUMEM_PCT, v, "nvidia.com/gpumem-percentage is percent of one card's memory, 0-100")
    cores = _hami_percent(c, name, HAMI_GPUCORES, v, "nvidia.com/gpucores is percent of one card's compute, 0-100")
    if cards is None or memory_mib < 0 or pct == -1 or cores == -1:
        return None
    if memory_mib and pct:
        c.add(name, f"{HAMI_GPUMEM},{HAMI_GPUMEM_PCT}", f"{show_value(v[HAMI_GPUMEM])},{show_value(v[HAMI_GPUMEM_PCT])}",
              "give one of nvidia.com/gpumem (MiB) or nvidia.com/gpumem-percentage (%), not both")
        return None
    whole_memory = not memory_mib and (pct is None or pct == 100)
    if cores is None and HAMI_GPUCORES not in v:
        cores = 100 if whole_memory else None
    if whole_memory or cores == 100:
        return ContainerRequest(name, Dialect.HAMI, cards=cards, core_milli=CORE_MILLI_PER_CARD, exclusive=True)
    core_milli = (cores or 0) * (CORE_MILLI_PER_CARD // 100)
    if memory_mib:
        return ContainerRequest(name, Dialect.HAMI, cards=cards, core_milli=core_milli, memory_mib=memory_mib)
    return ContainerRequest(name, Dialect.HAMI, cards=cards, core_milli=core_milli, memory_pct=pct)


_ELASTIC_FAMILIES = ((NANO_PERCENT,), (NANO_CORE, NANO_MEMORY), (EGPU_CORE, EGPU_MEMORY))


def _parse_elastic(c: _Collector, name: str, v: dict[str, Any], klass: AppClass, limits: CardLimits) -> ContainerRequest | None:
    """nano-gpu and elastic GPU. ``nano-gpu/gpu-percent`` P (1-100) is P % of one card, compute and
    memory alike (100: the whole card; nano-gpu gives a container one card). ``gpu-core`` and
    ``gpu-memory`` (``nano-gpu.io/`` or ``elasticgpu.io/``) read as qGPU's: core 1-99 shares one card,
    a multiple of 100 takes whole cards; memory is GiB of one card; memory alone is a share with no
    compute reserved, as elastic GPU books it."""
    families = [f for f in _ELASTIC_FAMILIES if any(k in v for k in f)]
    if len(families) > 1:
        c.add(name, ",".join(sorted(v)), "mixed",
              "a container asks in one of nano-gpu/gpu-percent, nano-gpu.io/gpu-core|gpu-memory or "
              "elasticgpu.io/gpu-core|gpu-memory")
        return None
    if NANO_PERCENT in v:
        pct = _one_card_percent(c, name, NANO_PERCENT, v[NANO_PERCENT], "nano-gpu/gpu-percent is percent of one card, 1-100",
                                "nano-gpu gives a container one card: at most 100")
        if pct is None:
            return None
        if pct == 100:
            return ContainerRequest(name, Dialect.ELASTIC, cards=1, core_milli=CORE_MILLI_PER_CARD, exclusive=True)
        return ContainerRequest(name, Dialect.ELASTIC, cards=1, core_milli=pct * (CORE_MILLI_PER_CARD // 100), memory_pct=pct)
    core_key, memory_key = families[0]
    prefix = core_key.split("/")[0]
    memory_mib = _card_memory(c, name, memory_key, v, MIB_PER_GIB, f"{prefix}/gpu-memory is whole GiB, an integer >= 1", limits)
    if memory_mib is None:
        return None
    if core_key not in v or is_zero(v[core_key]):  # memory only: a share with no compute reserved
        return ContainerRequest(name, Dialect.ELASTIC, cards=1, core_milli=0, memory_mib=memory_mib)
    shape = _core_cards(c, name, core_key, v[core_key], f"{prefix}/gpu-core", limits)
    if shape is None:
        return None
    cards, core_milli, exclusive = shape
    if not exclusive and not memory_mib:
        c.add(name, memory_key, "missing", f"a shared {core_key} (below 100) needs {memory_key}")
        return None
    return ContainerRequest(name, Dialect.ELASTIC, cards=cards, core_milli=core_milli, memory_mib=memory_mib, exclusive=exclusive)


_DIALECT_PARSERS = {
    Dialect.QGPU: _parse_qgpu,
    Dialect.VCUDA: _parse_vcuda,
    Dialect.T9K: _parse_t9k,
    Dialect.NVIDIA: _parse_nvidia,
    Dialect.HAMI: _parse_hami,
    Dialect.ELASTIC: _parse_elastic,
}


def _parse_app_class(c: _Collector, annotations: Mapping[str, Any]) -> AppClass:
    raw = annotations.get(QGPU_APP_CLASS)
    if raw is None:
        return AppClass.NORMAL
    if raw in (AppClass.ONLINE.value, AppClass.OFFLINE.value):
        return AppClass(raw)
    c.add("", f"annotation {QGPU_APP_CLASS}", raw, "must be online or offline (omit it for normal pods)")
    return AppClass.NORMAL


def _model_names(c: _Collector, key: str, raw: Any, separator: str, empty_rule: str) -> list[str] | None:
    """The GPU model names annotation ``key`` lists (split on ``separator``, blanks dropped), within
    :data:`MAX_MODEL_NAMES` and :data:`MAX_MODEL_NAME_CHARS`; or None after recording why not (an
    empty list too: ``empty_rule``). Refused, not cut: a pod asks for exactly the models it names."""
    text = str(raw)
    names = [n for n in (part.strip() for part in text.split(separator)) if n]
    if not names:
        c.add("", f"annotation {key}", raw, empty_rule)
        return None
    if len(names) > MAX_MODEL_NAMES:
        c.add("", f"annotation {key}", raw, f"lists {len(names)} GPU model names, at most {MAX_MODEL_NAMES} are allowed "
              "(a cluster has few models; leave the annotation out to take any card)")
        return None
    long = next((n for n in names if len(n) > MAX_MODEL_NAME_CHARS), None)
    if long is not None:
        c.add("", f"annotation {key}", raw, f"the GPU model name starting {long[:32]!r} has {len(long)} characters, "
              f"at most {MAX_MODEL_NAME_CHARS} are allowed (no card's name is longer)")
        return None
    return names


def _parse_models(c: _Collector, annotations: Mapping[str, Any]) -> frozenset[str] | None:
    raw = annotations.get(GPU_MODEL_ANNOTATION)
    if raw is None:
        return None
    names = _model_names(c, GPU_MODEL_ANNOTATION, raw, "|", "must list GPU models separated by '|', e.g. V100|T4")
    return None if names is None else frozenset(names)


def _parse_model_patterns(c: _Collector, annotations: Mapping[str, Any]) -> ModelPatterns | None:
    lists: list[tuple[str, ...]] = []
    for key in (HAMI_USE_GPUTYPE, HAMI_NOUSE_GPUTYPE):
        raw = annotations.get(key)
        names = None if raw is None else _model_names(
            c, key, raw, ",", "must list GPU model names separated by ',', e.g. A100,V100")
        lists.append(tuple(sorted({n.upper() for n in names or ()})))
    return ModelPatterns(lists[0], lists[1]) if any(lists) else None


_KAI_FRACTION_RULE = "gpu-fraction is the share of one card's memory, a decimal above 0 and below 1 (e.g. 0.5)"


def _kai_target(c: _Collector, annotations: Mapping[str, Any], spec: Mapping[str, Any],
                containers: list[Mapping[str, Any]], limits: CardLimits) -> ContainerRequest | None:
    """KAI-Scheduler's (Run:ai's) share, for pods naming ``schedulerName: kai-scheduler``: the
    annotations give the container named by ``gpu-fraction-container-name`` (default: the first)
    ``gpu-fraction`` of each card's memory, or ``gpu-memory`` MiB, on ``gpu-fraction-num-devices``
    distinct cards (default 1). KAI reserves no compute for a fraction: nor does this request."""
    if spec.get("schedulerName") != KAI_SCHEDULER or not any(k in annotations for k in KAI_ANNOTATIONS):
        return None
    fraction_raw, memory_raw = annotations.get(KAI_FRACTION), annotations.get(KAI_MEMORY)
    if fraction_raw is None and memory_raw is None:
        given = next(k for k in KAI_ANNOTATIONS if k in annotations)
        c.add("", f"annotation {given}", annotations[given], f"needs annotation {KAI_FRACTION} or {KAI_MEMORY}")
        return None
    if fraction_raw is not None and memory_raw is not None:
        c.add("", f"annotations {KAI_FRACTION},{KAI_MEMORY}", f"{show_value(fraction_raw)},{show_value(memory_raw)}",
              "give one of gpu-fraction (share of a card) or gpu-memory (MiB), not both")
        return None
    names = [str(ct.get("name") or "") for ct in containers]
    target = str(annotations.get(KAI_CONTAINER) or (names[0] if names else ""))
    if target not in names:
        c.add("", f"annotation {KAI_CONTAINER}", annotations.get(KAI_CONTAINER, target),
              f"must name one of the pod's containers: {', '.join(map(repr, names)) or 'none'}")
        return None
    before = len(c.problems)
    cards = 1
    if KAI_NUM_DEVICES in annotations:
        raw = annotations[KAI_NUM_DEVICES]
        cards = _integer(c, target, f"annotation {KAI_NUM_DEVICES}", raw, "gpu-fraction-num-devices counts cards, an integer >= 1") or 0
        if cards > limits.max_cards_per_node:
            c.add(target, f"annotation {KAI_NUM_DEVICES}", raw, f"no node could ever hold it: at most {limits.max_cards_per_node} cards per node")
    pct = memory_mib = 0
    if fraction_raw is not None:
        try:
            fraction = parse_quantity(fraction_raw)
        except QuantityError as exc:
            c.add(target, f"annotation {KAI_FRACTION}", fraction_raw, f"{exc.rule}; {_KAI_FRACTION_RULE}")
        else:
            if not 0 < fraction < 1:
                c.add(target, f"annotation {KAI_FRACTION}", fraction_raw, f"out of range; {_KAI_FRACTION_RULE}; "
                      "ask nvidia.com/gpu for whole cards")
            else:
                pct = math.ceil(fraction * 100)  # rounded up to whole percent
    else:
        memory_mib = _integer(c, target, f"annotation {KAI_MEMORY}", memory_raw, "gpu-memory is MiB of one card, an integer") or 0
        if memory_mib > limits.max_card_memory_mib:
            c.add(target, f"annotation {KAI_MEMORY}", memory_raw,
                  f"no card could ever hold it: the largest card has {limits.max_card_memory_mib} MiB")
    container = containers[names.index(target)]
    lim, req = _resources(container, "limits"), _resources(container, "requests")
    for key in sorted(k for k in set(lim) | set(req) if k in GPU_RESOURCES or k.startswith(QGPU_PREFIX)):
        value = lim.get(key, req.get(key))
        carrier = key == NVIDIA_GPU and all(_same_quantity(side[key], cards) for side in (lim, req) if key in side)
        if not carrier:  # the webhook's own nvidia.com/gpu count for the kubelet passes; nothing else
            c.add(target, key, value, f"the container's GPU share comes from annotation {KAI_FRACTION} or {KAI_MEMORY} "
                  f"(KAI-Scheduler); it may ask no GPU resource itself (nvidia.com/gpu only as {cards}, the card count)")
    if len(c.problems) != before:
        return None
    return ContainerRequest(target, Dialect.KAI, cards=cards, core_milli=0, memory_mib=memory_mib, memory_pct=pct or None)


def _compute(resources: Mapping[str, Any] | None, fallback: Mapping[str, Any] | None = None) -> tuple[Decimal, Decimal]:
    """CPU (cores) and memory (bytes) of one requests map, each taken from ``fallback`` (the
    limits, which the apiserver copies into absent requests) when absent; 0 when neither has it."""
    out = []
    for name in ("cpu", "memory"):
        value = (resources or {}).get(name)
        if value is None:
            value = (fallback or {}).get(name)
        try:
            out.append(parse_quantity(value) if value is not None else Decimal(0))
        except QuantityError:
            out.append(Decimal(0))  # the apiserver validates CPU and memory; not our rule to enforce
    return out[0], out[1]


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _pod_compute(spec: Mapping[str, Any]) -> tuple[int, int]:
    """The pod's CPU (milli) and memory (MiB) requests as kube-scheduler counts them; used for node
    fit only. Pod-level ``resources`` (where set) stand for the containers'; otherwise the sum of
    the containers and of the sidecars (init containers with ``restartPolicy: Always``), or the
    largest regular init container together with the sidecars started before it, whichever is
    larger; plus the pod's ``overhead``. Before, only the containers were summed: a pod asking
    32 CPUs at pod level, or in an init container, counted as none."""
    def of(container: Mapping[str, Any]) -> tuple[Decimal, Decimal]:
        return _compute(_mapping(_mapping(container.get("resources")).get("requests")),
                        _mapping(_mapping(container.get("resources")).get("limits")))

    containers = [c for c in spec.get("containers") or [] if isinstance(c, Mapping)]
    cpu = sum((of(c)[0] for c in containers), Decimal(0))
    mem = sum((of(c)[1] for c in containers), Decimal(0))
    side_cpu = side_mem = init_cpu = init_mem = Decimal(0)
    for init in (c for c in spec.get("initContainers") or [] if isinstance(c, Mapping)):
        c_cpu, c_mem = of(init)
        if init.get("restartPolicy") == "Always":  # a sidecar: runs on beside what follows
            side_cpu, side_mem = side_cpu + c_cpu, side_mem + c_mem
        else:
            init_cpu, init_mem = max(init_cpu, side_cpu + c_cpu), max(init_mem, side_mem + c_mem)
    cpu, mem = max(cpu + side_cpu, init_cpu), max(mem + side_mem, init_mem)
    pod_level = _mapping(spec.get("resources"))
    if pod_level:
        level_cpu, level_mem = _compute(_mapping(pod_level.get("requests")), _mapping(pod_level.get("limits")))
        cpu, mem = (level_cpu or cpu), (level_mem or mem)
    over_cpu, over_mem = _compute(_mapping(spec.get("overhead")))
    return int((cpu + over_cpu) * 1000), int((mem + over_mem) / (1024 * 1024))


def pod_compute(pod: Mapping[str, Any]) -> tuple[int, int]:
    """The pod's CPU (milli) and memory (MiB) requests as :func:`parse_pod` counts them, without
    parsing its GPU requests: what the extender's cache keeps of a pod that already books cards."""
    return _pod_compute(_mapping(pod.get("spec")))


def parse_pod(pod: Mapping[str, Any], limits: CardLimits = DEFAULT_LIMITS) -> PodRequest:
    """Parse a pod (API dict) into one :class:`PodRequest`, or raise :class:`RequestError`.

    All problems of the pod are reported together. A pod that asks for nothing of ours parses to
    a request with no containers (``wants_gpu`` is False). Of the pod's annotations it reads
    :data:`REQUEST_ANNOTATIONS` and no other.
    """
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    annotations = meta.get("annotations") or {}
    c = _Collector()
    klass = _parse_app_class(c, annotations)
    models = _parse_models(c, annotations)
    patterns = _parse_model_patterns(c, annotations)
    containers = [ct for ct in (spec.get("containers") or []) if isinstance(ct, Mapping)]
    kai = _kai_target(c, annotations, spec, containers, limits)
    parsed: list[ContainerRequest] = []
    for container in containers:
        if kai is not None and str(container.get("name") or "") == kai.name:
            parsed.append(kai)
            continue
        result = _parse_container(c, container, klass, limits)
        if result is not None:
            parsed.append(result)
    for init in spec.get("initContainers") or []:
        if isinstance(init, Mapping):
            lim, req = _resources(init, "limits"), _resources(init, "requests")
            ours = {k for k in set(lim) | set(req) if k in GPU_RESOURCES or k.startswith(QGPU_PREFIX)}
            for key in sorted(ours):
                value = lim.get(key, req.get(key))
                if not is_zero(value):  # zero asks no GPU, in an init container too
                    c.add(str(init.get("name") or ""), key, value, "init containers may not request shared GPUs")
    node_askers = [r.name for r in parsed if r.whole_node]
    if len(node_askers) > 1:
        c.add(node_askers[1], T9K_GPU_NODE, "1", f"at most one container per pod may ask for the whole node (also asked by {node_askers[0]!r})")
    if node_askers and len(parsed) > 1:
        others = [r.name for r in parsed if not r.whole_node]
        if others:
            c.add(others[0], "GPU resources", "given", f"container {node_askers[0]!r} takes the whole node; no other container may ask for GPUs")
    if klass is not AppClass.NORMAL and parsed and any(r.dialect is not Dialect.QGPU for r in parsed):
        bad = next(r for r in parsed if r.dialect is not Dialect.QGPU)
        c.add(bad.name, f"annotation {QGPU_APP_CLASS}", klass.value, "online/offline classes apply to tke.cloud.tencent.com/qgpu-* requests only")
    t9k_modes = {("sgn" if r.memory_pct is not None else "xgn") for r in parsed if r.dialect is Dialect.T9K and not r.whole_node}
    if len(t9k_modes) > 1:
        bad = next(r for r in parsed if r.memory_pct is not None)
        c.add(bad.name, T9K_GPU_PERCENT, str(bad.memory_pct),
              "a pod cannot mix tensorstack.dev/nvidia-gpu (xgn nodes) with nvidia-gpu-percent (sgn nodes)")
    if c.problems:
        raise RequestError(c.problems)
    alloc_mode = None
    if any(r.dialect is Dialect.T9K for r in parsed):
        # nvidia-gpu and nvidia-gpu-node go to xgn nodes (T9k's whole-card and whole-node modes),
        # nvidia-gpu-percent to sgn nodes.
        alloc_mode = "sgn" if any(r.memory_pct is not None for r in parsed) else "xgn"
    cpu, mem = _pod_compute(spec)
    return PodRequest(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or meta.get("generateName") or ""),
        uid=str(meta.get("uid") or ""),
        klass=klass,
        containers=tuple(parsed),
        models=models,
        alloc_mode=alloc_mode,
        model_patterns=patterns,
        cpu_milli=cpu,
        memory_mib=mem,
    )
