"""Reading GPU cluster traces (the Alibaba 'openb' format) into engine values.

Columns, as published with the FGD study:
- nodes: ``sn, cpu_milli, memory_mib, gpu, model``
- pods: ``name, cpu_milli, memory_mib, num_gpu, gpu_milli`` and optionally ``gpu_spec, qos,
  pod_phase, creation_time, deletion_time, scheduled_time`` (some variants carry only the first five).
A missing required column or a bad value raises :class:`TraceError` naming the file, line, column
and value, so the CLI can print one line and exit 2.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, AppClass, ContainerRequest, Dialect, PodRequest
from qgpu_runtime.placement.state import CardSpec, NodeSpec

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")

# Card memory by model, for the optional GPU-memory replay. G2/G3 are undisclosed in the trace.
CARD_MEMORY_MIB = {"T4": 16384, "P100": 16384, "V100M16": 16384, "V100M32": 32768, "A10": 24576}
UNKNOWN_CARD_MEMORY_MIB = 32768


class TraceError(ValueError):
    """A trace file that cannot be read as the format says."""


@dataclass(frozen=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    models: frozenset[str] | None
    creation_time: int | None
    deletion_time: int | None

    @property
    def gpu_request_milli(self) -> int:
        """GPU demand in thousandths of a card: what 'arrived GPU' counts."""
        return self.num_gpu * self.gpu_milli

    def request(self, gpu_memory_mib: int = 0) -> PodRequest:
        """The engine's request for this pod: gpu_milli below 1000 shares one card, otherwise
        num_gpu whole cards."""
        containers: tuple[ContainerRequest, ...] = ()
        if self.num_gpu:
            if self.gpu_milli < CORE_MILLI_PER_CARD:
                containers = (ContainerRequest("main", Dialect.QGPU, 1, self.gpu_milli, gpu_memory_mib),)
            else:
                containers = (ContainerRequest("main", Dialect.QGPU, self.num_gpu, CORE_MILLI_PER_CARD, exclusive=True),)
        return PodRequest("trace", self.name, klass=AppClass.NORMAL, containers=containers,
                          models=self.models, cpu_milli=self.cpu_milli, memory_mib=self.memory_mib)


def _rows(path: Path, required: tuple[str, ...]):
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open: {exc.strerror}") from None
    with handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(f"{path}:1: missing required column(s) {', '.join(missing)} (header: {', '.join(header) or 'empty'})")
        for row in reader:
            yield reader.line_num, row


def _int(path: Path, line: int, row: dict, column: str, minimum: int = 0, optional: bool = False) -> int | None:
    raw = row.get(column)
    if raw is None or raw.strip() == "":
        if optional:
            return None
        raise TraceError(f"{path}:{line}: column {column}: empty value; must be an integer >= {minimum}")
    try:
        value = int(raw)
    except ValueError:
        raise TraceError(f"{path}:{line}: column {column}: {raw!r} is not an integer") from None
    if value < minimum:
        raise TraceError(f"{path}:{line}: column {column}: {value} is below the minimum {minimum}")
    return value


def load_nodes(path: str | Path, gpu_memory: bool = False) -> list[NodeSpec]:
    """Nodes of a trace. Card memory matters only when the replay models GPU memory."""
    path = Path(path)
    nodes = []
    for line, row in _rows(path, NODE_COLUMNS):
        name = (row["sn"] or "").strip()
        if not name:
            raise TraceError(f"{path}:{line}: column sn: empty node name")
        gpus = _int(path, line, row, "gpu")
        model = (row["model"] or "").strip() or "unknown"
        memory = CARD_MEMORY_MIB.get(model, UNKNOWN_CARD_MEMORY_MIB)
        cards = tuple(CardSpec(i, f"{name}-gpu{i}", model, memory) for i in range(gpus or 0))
        nodes.append(NodeSpec(name, _int(path, line, row, "cpu_milli"), _int(path, line, row, "memory_mib"), cards))
    if not nodes:
        raise TraceError(f"{path}: no nodes")
    return nodes


def load_pods(path: str | Path) -> list[TracePod]:
    path = Path(path)
    pods = []
    for line, row in _rows(path, POD_COLUMNS):
        num_gpu = _int(path, line, row, "num_gpu")
        gpu_milli = _int(path, line, row, "gpu_milli")
        assert num_gpu is not None and gpu_milli is not None
        if gpu_milli > CORE_MILLI_PER_CARD:
            raise TraceError(f"{path}:{line}: column gpu_milli: {gpu_milli} is above {CORE_MILLI_PER_CARD} (one card)")
        if num_gpu > 1 and gpu_milli != CORE_MILLI_PER_CARD:
            raise TraceError(f"{path}:{line}: column gpu_milli: {gpu_milli} with num_gpu={num_gpu}: multi-GPU pods take whole cards (1000)")
        if num_gpu and not gpu_milli:
            raise TraceError(f"{path}:{line}: column gpu_milli: 0 with num_gpu={num_gpu}: a GPU pod needs a share above 0")
        spec = (row.get("gpu_spec") or "").strip()
        models = frozenset(m for m in spec.split("|") if m) or None
        pods.append(TracePod(
            name=(row["name"] or "").strip() or f"line-{line}",
            cpu_milli=_int(path, line, row, "cpu_milli"),
            memory_mib=_int(path, line, row, "memory_mib"),
            num_gpu=num_gpu,
            gpu_milli=gpu_milli if num_gpu else 0,
            models=models,
            creation_time=_int(path, line, row, "creation_time", optional=True) if "creation_time" in row else None,
            deletion_time=_int(path, line, row, "deletion_time", optional=True) if "deletion_time" in row else None,
        ))
    if not pods:
        raise TraceError(f"{path}: no pods")
    return pods
