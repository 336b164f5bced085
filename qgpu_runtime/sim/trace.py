"""Reading GPU cluster traces (the Alibaba 'openb' format) into engine values.

Columns, as published with the FGD study:
- nodes: ``sn, cpu_milli, memory_mib, gpu, model``
- pods: ``name, cpu_milli, memory_mib, num_gpu, gpu_milli`` and optionally ``gpu_spec, qos,
  pod_phase, creation_time, deletion_time, scheduled_time`` (some variants carry only the first five).
A missing required column or a bad value raises :class:`TraceError` naming the file, line, column
and value, so the CLI can print one line and exit 2.

Whoever hands us the files is not trusted with our memory: every number is bounded before it is
used (a ``gpu`` of 10^8 cards took 1.9 GB before the replay began, a ``cpu_milli`` of 10^30
overflowed the engine's int64 arrays), node and pod names must be unique (the cluster state keys
nodes by name; a repeated pod name once made the time-ordered replay submit the later pod twice),
and the files must be UTF-8.
"""

from __future__ import annotations

import codecs
import csv
import re
from dataclasses import dataclass
from pathlib import Path

from qgpu_runtime.contract.inventory import MAX_CARDS
from qgpu_runtime.model.requests import (
    CORE_MILLI_PER_CARD,
    MAX_MODEL_NAME_CHARS,
    MAX_MODEL_NAMES,
    AppClass,
    ContainerRequest,
    Dialect,
    PodRequest,
)
from qgpu_runtime.placement.state import CardSpec, NodeSpec

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")

# Card memory by model, for the optional GPU-memory replay. G2/G3 are undisclosed in the trace.
CARD_MEMORY_MIB = {"T4": 16384, "P100": 16384, "V100M16": 16384, "V100M32": 32768, "A10": 24576}
UNKNOWN_CARD_MEMORY_MIB = 32768

MAX_CPU_MILLI = 10_000_000
"""CPU of one node or pod, in thousandths of a CPU: 10,000 CPUs, about five times the largest
single machines sold (1,792 threads); the bundled trace's largest node has 128."""
MAX_MEMORY_MIB = 1 << 26
"""Memory of one node or pod: 64 TiB, above the largest single machines sold (48 TB); the bundled
trace's largest node has 1 TiB."""
MAX_TIME = 2**63 - 1
"""``creation_time`` and ``deletion_time``: seconds that fit an int64."""
MAX_INT_CHARS = 24
"""A cell longer than this is not read as a number at all (2^63 has 19 digits)."""
_DIGITS = re.compile(r"[+-]?[0-9]+")
MAX_LINE_CHARS = 1 << 20
"""A row of a trace is under 200 characters; a gpu_spec at its bound (16 names of 96) under 2,000.
Above the CSV reader's own field limit (131,072), which then names the cell first."""
MAX_NODES = 100_000
"""Nodes of one trace: the bundled one has 1,523; the largest GPU clusters run tens of thousands."""
MAX_PODS = 2_000_000
"""Pods of one trace: the bundled one has 8,152; two million is past any published GPU cluster
trace, and a replay of that many stops being a laptop's work."""
SHOWN_CHARS = 32
"""How much of a bad cell an error message quotes."""

# ``gpu`` of a node and ``num_gpu`` of a pod: cards of one machine, the bound the node inventory
# keeps (contract/inventory.py); a pod asking for more could never be placed.
NODE_BOUNDS = {"cpu_milli": MAX_CPU_MILLI, "memory_mib": MAX_MEMORY_MIB, "gpu": MAX_CARDS}
POD_BOUNDS = {"cpu_milli": MAX_CPU_MILLI, "memory_mib": MAX_MEMORY_MIB, "num_gpu": MAX_CARDS,
              "creation_time": MAX_TIME, "deletion_time": MAX_TIME}


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


def _shown(raw: str) -> str:
    """A cell as an error quotes it: repr, cut to a readable length."""
    return repr(raw) if len(raw) <= SHOWN_CHARS else repr(raw[:SHOWN_CHARS]) + f"… ({len(raw)} characters)"


def _not_utf8(path: Path) -> TraceError:
    """Where the file stops being UTF-8: the byte offset and line of the first bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = lines = 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            pending = decoder.getstate()[0]
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                bad = offset - len(pending) + exc.start
                line = lines + chunk[: max(bad - offset, 0)].count(b"\n") + 1
                return TraceError(f"{path}:{line}: byte offset {bad}: 0x{(pending + chunk)[exc.start]:02x} is not UTF-8; "
                                  "trace files must be UTF-8 text")
            offset += len(chunk)
            lines += chunk.count(b"\n")
    return TraceError(f"{path}:{lines + 1}: byte offset {offset - len(decoder.getstate()[0])}: the file ends inside a "
                      "UTF-8 character; trace files must be UTF-8 text")


def _lines(path: Path, handle):
    """The file's lines, each at most :data:`MAX_LINE_CHARS` characters (``/dev/zero``, or a file
    without line breaks, once read into memory without end)."""
    count = 0
    while line := handle.readline(MAX_LINE_CHARS + 1):
        count += 1
        if len(line) > MAX_LINE_CHARS:
            raise TraceError(f"{path}:{count}: a line longer than {MAX_LINE_CHARS} characters; not a trace row")
        yield line


def _rows(path: Path, required: tuple[str, ...], max_rows: int):
    try:
        handle = path.open(newline="", encoding="utf-8-sig")  # a byte-order mark (Excel's UTF-8 CSV) is not a column name
    except OSError as exc:
        raise TraceError(f"{path}: cannot open: {exc.strerror}") from None
    with handle:
        reader = csv.DictReader(_lines(path, handle), strict=True)
        try:
            header = reader.fieldnames or []
            missing = [c for c in required if c not in header]
            if missing:
                shown = ", ".join(header) or "empty"
                if len(shown) > 10 * SHOWN_CHARS:
                    shown = shown[: 10 * SHOWN_CHARS] + "…"
                raise TraceError(f"{path}:1: missing required column(s) {', '.join(missing)} (header: {shown})")
            for count, row in enumerate(reader, 1):
                if count > max_rows:
                    raise TraceError(f"{path}:{reader.line_num}: more than {max_rows} rows; a trace holds at most {max_rows}")
                yield reader.line_num, row
        except UnicodeDecodeError:
            raise _not_utf8(path) from None
        except csv.Error as exc:
            raise TraceError(f"{path}:{reader.line_num + 1}: not CSV: {exc}") from None


def _int(path: Path, line: int, row: dict, column: str, bounds: dict[str, int], minimum: int = 0,
         optional: bool = False) -> int | None:
    raw = row.get(column)
    if raw is None or raw.strip() == "":
        if optional:
            return None
        raise TraceError(f"{path}:{line}: column {column}: empty value; must be an integer >= {minimum}")
    maximum = bounds.get(column)  # None: the caller checks the upper bound with its own rule
    text = raw.strip()
    if len(text) > MAX_INT_CHARS:  # not converted at all: far beyond every bound, or not a number
        if _DIGITS.fullmatch(text):
            above = f"is above the maximum {maximum}" if maximum is not None else "is above any value of this column"
            rule = f"is below the minimum {minimum}" if text.startswith("-") else above
        else:
            rule = "is not an integer"
        raise TraceError(f"{path}:{line}: column {column}: {_shown(raw)} {rule}")
    try:
        value = int(text)
    except ValueError:
        raise TraceError(f"{path}:{line}: column {column}: {_shown(raw)} is not an integer") from None
    if value < minimum:
        raise TraceError(f"{path}:{line}: column {column}: {value} is below the minimum {minimum}")
    if maximum is not None and value > maximum:
        raise TraceError(f"{path}:{line}: column {column}: {value} is above the maximum {maximum}")
    return value


def _unique(path: Path, line: int, column: str, name: str, seen: dict[str, int], what: str) -> None:
    first = seen.setdefault(name, line)
    if first != line:
        raise TraceError(f"{path}:{line}: column {column}: {_shown(name)} repeats the {what} of line {first}; "
                         f"{what} names must be unique")


def load_nodes(path: str | Path, gpu_memory: bool = False) -> list[NodeSpec]:
    """Nodes of a trace. Card memory matters only when the replay models GPU memory. A file
    without a single card is refused: every figure of a replay is a share of the GPU capacity."""
    path = Path(path)
    nodes = []
    seen: dict[str, int] = {}
    for line, row in _rows(path, NODE_COLUMNS, MAX_NODES):
        name = (row["sn"] or "").strip()
        if not name:
            raise TraceError(f"{path}:{line}: column sn: empty node name")
        _unique(path, line, "sn", name, seen, "node")
        gpus = _int(path, line, row, "gpu", NODE_BOUNDS)
        cpu = _int(path, line, row, "cpu_milli", NODE_BOUNDS)
        memory_mib = _int(path, line, row, "memory_mib", NODE_BOUNDS)
        model = (row["model"] or "").strip() or "unknown"
        memory = CARD_MEMORY_MIB.get(model, UNKNOWN_CARD_MEMORY_MIB)
        cards = tuple(CardSpec(i, f"{name}-gpu{i}", model, memory) for i in range(gpus or 0))
        nodes.append(NodeSpec(name, cpu, memory_mib, cards))
    if not nodes:
        raise TraceError(f"{path}: no nodes")
    if not any(node.cards for node in nodes):
        raise TraceError(f"{path}: no GPU capacity: every node has gpu 0, and the replay measures "
                         "allocation as a share of the cluster's cards")
    return nodes


def load_pods(path: str | Path) -> list[TracePod]:
    path = Path(path)
    pods = []
    seen: dict[str, int] = {}
    for line, row in _rows(path, POD_COLUMNS, MAX_PODS):
        num_gpu = _int(path, line, row, "num_gpu", POD_BOUNDS)
        gpu_milli = _int(path, line, row, "gpu_milli", POD_BOUNDS)
        assert num_gpu is not None and gpu_milli is not None
        if gpu_milli > CORE_MILLI_PER_CARD:
            raise TraceError(f"{path}:{line}: column gpu_milli: {gpu_milli} is above {CORE_MILLI_PER_CARD} (one card)")
        if num_gpu > 1 and gpu_milli != CORE_MILLI_PER_CARD:
            raise TraceError(f"{path}:{line}: column gpu_milli: {gpu_milli} with num_gpu={num_gpu}: multi-GPU pods take whole cards (1000)")
        if num_gpu and not gpu_milli:
            raise TraceError(f"{path}:{line}: column gpu_milli: 0 with num_gpu={num_gpu}: a GPU pod needs a share above 0")
        name = (row["name"] or "").strip() or f"line-{line}"
        _unique(path, line, "name", name, seen, "pod")
        spec = (row.get("gpu_spec") or "").strip()
        names = [m for m in spec.split("|") if m]
        if len(names) > MAX_MODEL_NAMES or any(len(m) > MAX_MODEL_NAME_CHARS for m in names):
            raise TraceError(f"{path}:{line}: column gpu_spec: {_shown(spec)} lists {len(names)} GPU models, the longest of "
                             f"{max(map(len, names))} characters; at most {MAX_MODEL_NAMES} of at most "
                             f"{MAX_MODEL_NAME_CHARS} (the bound of qgpu.io/gpu-model)")
        models = frozenset(names) or None
        created = _int(path, line, row, "creation_time", POD_BOUNDS, optional=True) if "creation_time" in row else None
        deleted = _int(path, line, row, "deletion_time", POD_BOUNDS, optional=True) if "deletion_time" in row else None
        if created is not None and deleted is not None and deleted < created:
            raise TraceError(f"{path}:{line}: column deletion_time: {deleted} is before creation_time {created}; "
                             "a pod leaves after it arrives")
        pods.append(TracePod(
            name=name,
            cpu_milli=_int(path, line, row, "cpu_milli", POD_BOUNDS),
            memory_mib=_int(path, line, row, "memory_mib", POD_BOUNDS),
            num_gpu=num_gpu,
            gpu_milli=gpu_milli if num_gpu else 0,
            models=models,
            creation_time=created,
            deletion_time=deleted,
        ))
    if not pods:
        raise TraceError(f"{path}: no pods")
    return pods
