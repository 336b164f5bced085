"""Simulated GPUs for hosts without them: tests, demos, benchmarks.

Chosen only on purpose (``--gpu-backend simulated``); never a fallback when NVML fails.
Cards come from a spec string (``2xT4-16G`` or ``8xV100-32G,1xA100-80G``) or a YAML/JSON file.
Usage and health are driven from outside through an optional *control file* (JSON), re-read when
it changes, so a test or a demo can make a card busy or raise an XID on a running manager:

    {"usage": {"0": {"util_pct": 40, "memory_used_mib": 2048}},
     "processes": [{"pid": 4242, "card_index": 0, "memory_mib": 1024, "sm_util_pct": 30,
                    "cgroup": "0::/kubepods/pod<uid>/<container-id>"}],
     "unhealthy": {"1": "XID 79"}}

A card listed under "unhealthy" is reported once; taken out of the list again, it is reported fit
(what a reset of a real card does).
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from qgpu_runtime.contract.cliflags import read_small_text
from qgpu_runtime.contract.inventory import MAX_CARDS, MAX_ID_CHARS, MAX_MEMORY_MIB
from qgpu_runtime.gpu.types import BackendError, CardInfo, CardUsage, HealthEvent, ProcessUsage

_SPEC = re.compile(r"^(?:(?P<count>[0-9]+)x)?(?P<model>[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*?)-(?P<mem>[0-9]+)(?P<unit>G|GiB|M|MiB)$")
MAX_CONFIG_BYTES = 1024 * 1024
"""A config file of 16 cards is a few hundred bytes; a larger one is not a config file."""
_UUID_NS = uuid.UUID("6d1b8f1e-3a52-4c55-9a51-7a0f2b0c1a9e")


@dataclass(frozen=True)
class SimulatedCardSpec:
    model: str
    memory_mib: int
    count: int = 1


def _bounded(where: str, model: str, memory_mib: int, count: int, total: int) -> SimulatedCardSpec:
    """One spec within the bounds a real node's inventory keeps (contract/inventory.py): at most
    :data:`MAX_CARDS` cards in all, 1 MiB..1 TiB each, a model name of at most 96 characters. A
    count of 10^9 once built a billion cards and took all the host's memory."""
    if count < 1:
        raise ValueError(f"--simulated-gpus: {where}: count must be at least 1")
    if total + count > MAX_CARDS:
        raise ValueError(f"--simulated-gpus: {where}: count {count} makes {total + count} cards; a node has at most {MAX_CARDS}")
    if not 1 <= memory_mib <= MAX_MEMORY_MIB:
        raise ValueError(f"--simulated-gpus: {where}: memory {memory_mib} MiB must be within 1..{MAX_MEMORY_MIB} (1 TiB)"
                         if memory_mib >= 1 else f"--simulated-gpus: {where}: memory must be positive")
    if not 1 <= len(model) <= MAX_ID_CHARS:
        raise ValueError(f"--simulated-gpus: {where}: model name of {len(model)} characters; must have 1..{MAX_ID_CHARS}")
    return SimulatedCardSpec(model, memory_mib, count)


def _digits(text: str) -> int:
    """ASCII digits as an int, any beyond 18 digits read as 10^18 (above every bound)."""
    return int(text) if len(text.lstrip("0")) <= 18 else 10**18


def parse_spec(spec: str) -> tuple[SimulatedCardSpec, ...]:
    """``2xT4-16G,1xA100-80G`` -> card specs. Memory unit G/GiB (GiB) or M/MiB (MiB); at most
    :data:`MAX_CARDS` cards of at most 1 TiB each."""
    out: list[SimulatedCardSpec] = []
    for part in (p.strip() for p in spec.split(",")):
        m = _SPEC.match(part)
        if not m:
            shown = repr(part) if len(part) <= 64 else repr(part[:64]) + f"… ({len(part)} characters)"
            raise ValueError(f"--simulated-gpus: {shown} is not a card spec: write COUNTxMODEL-MEMORY, "
                             "e.g. 2xT4-16G or 1xA100-80G (memory in G or M)")
        # digits past 18 are far beyond every bound: not converted (a 5,000-digit count is refused
        # by int() itself, with a traceback)
        count = _digits(m["count"] or "1")
        memory = _digits(m["mem"]) * (1024 if m["unit"] in ("G", "GiB") else 1)
        out.append(_bounded(repr(part) if len(part) <= 64 else repr(part[:64]) + "…", m["model"], memory, count,
                            sum(s.count for s in out)))
    return tuple(out)


def load_config(path: Path) -> tuple[tuple[SimulatedCardSpec, ...], Path | None]:
    """A YAML/JSON file: ``{cards: [{model, memory_mib, count}], control: PATH}``."""
    text = read_small_text(path, MAX_CONFIG_BYTES, f"--simulated-gpus: {path}", "a config file")
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        raise ValueError(f"--simulated-gpus: {path}: not valid YAML/JSON: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cards"), list) or not data["cards"]:
        raise ValueError(f"--simulated-gpus: {path}: needs a non-empty 'cards' list")
    specs: list[SimulatedCardSpec] = []
    for i, card in enumerate(data["cards"]):
        try:
            model, memory, count = card["model"], card["memory_mib"], card.get("count", 1)
            if not isinstance(model, str) or any(isinstance(v, bool) or not isinstance(v, int) for v in (memory, count)):
                raise TypeError
        except (KeyError, TypeError, AttributeError):
            shown = repr(card) if len(repr(card)) <= 64 else repr(card)[:64] + "…"
            raise ValueError(f"--simulated-gpus: {path}: cards[{i}] needs model (a string), memory_mib and count "
                             f"(integers) (got {shown})") from None
        specs.append(_bounded(f"{path}: cards[{i}]", model, memory, count, sum(s.count for s in specs)))
    control = data.get("control")
    if control is not None and not isinstance(control, str):
        raise ValueError(f"--simulated-gpus: {path}: control must be a file name (got {type(control).__name__})")
    return tuple(specs), (path.parent / control if control else None)


def specs_from_option(option: str) -> tuple[tuple[SimulatedCardSpec, ...], Path | None]:
    """``--simulated-gpus``: a spec string, or the path of a YAML/JSON config file (then also its
    control file, if it names one)."""
    path = Path(option)
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a name too long for a path, or with a NUL: a spec, not a file
        is_file = False
    if path.suffix in (".yaml", ".yml", ".json") or is_file:
        return load_config(path)
    return parse_spec(option), None


def build_cards(specs: tuple[SimulatedCardSpec, ...], seed: str) -> tuple[CardInfo, ...]:
    """Cards with stable UUIDs: the same seed (node name) and spec always give the same UUIDs."""
    cards = []
    for spec in specs:
        for _ in range(spec.count):
            index = len(cards)
            uid = uuid.uuid5(_UUID_NS, f"{seed}/{index}/{spec.model}")
            cards.append(CardInfo(index=index, uuid=f"GPU-{uid}", model=spec.model,
                                  memory_mib=spec.memory_mib, minor=index))
    return tuple(cards)


class SimulatedBackend:
    """Cards from a spec; usage and XIDs from the control file (if any)."""

    name = "simulated"

    def __init__(self, cards: tuple[CardInfo, ...], control: Path | None = None) -> None:
        if not cards:
            raise BackendError("simulated backend needs at least one card")
        self._cards = cards
        self._control = control
        self._control_stamp: tuple[int, int] | None = None
        self._state: dict[str, Any] = {}
        self._reported_unhealthy: set[int] = set()
        self._closed = threading.Event()

    @classmethod
    def from_option(cls, option: str, seed: str) -> "SimulatedBackend":
        """``option`` is a spec string or the path of a config file."""
        specs, control = specs_from_option(option)
        return cls(build_cards(specs, seed), control)

    def _read_control(self) -> dict[str, Any]:
        if self._control is None:
            return {}
        try:
            st = self._control.stat()
        except FileNotFoundError:
            return self._state
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._control_stamp:
            try:
                self._state = json.loads(self._control.read_text() or "{}")
                self._control_stamp = stamp
            except (OSError, json.JSONDecodeError):
                pass  # a writer is mid-write; keep the previous state and read it next time
        return self._state

    def cards(self) -> tuple[CardInfo, ...]:
        return self._cards

    def sample(self) -> tuple[CardUsage, ...]:
        state = self._read_control()
        usage = state.get("usage") or {}
        procs: dict[int, list[ProcessUsage]] = {}
        for p in state.get("processes") or []:
            proc = ProcessUsage(int(p["pid"]), int(p["card_index"]), int(p.get("memory_mib", 0)),
                                int(p.get("sm_util_pct", 0)), str(p.get("cgroup", "")))
            procs.setdefault(proc.card_index, []).append(proc)
        out = []
        for card in self._cards:
            u = usage.get(str(card.index)) or {}
            mine = tuple(procs.get(card.index, ()))
            util = int(u.get("util_pct", min(100, sum(p.sm_util_pct for p in mine))))
            mem = int(u.get("memory_used_mib", sum(p.memory_mib for p in mine)))
            out.append(CardUsage(card.index, util, mem, mine))
        return tuple(out)

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        unhealthy = self._read_control().get("unhealthy") or {}
        events = [HealthEvent(int(i), str(reason)) for i, reason in sorted(unhealthy.items())
                  if int(i) not in self._reported_unhealthy and 0 <= int(i) < len(self._cards)]
        # a card taken out of the control file's "unhealthy" is fit again (what a reset does)
        events += [HealthEvent(i, "no longer marked unhealthy in the control file", healthy=True)
                   for i in sorted(self._reported_unhealthy - {int(k) for k in unhealthy})]
        if events:
            for e in events:
                (self._reported_unhealthy.discard if e.healthy else self._reported_unhealthy.add)(e.card_index)
            return events
        self._closed.wait(timeout_s)
        return []

    def close(self) -> None:
        self._closed.set()
