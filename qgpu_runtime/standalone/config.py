"""Standalone host settings: which cards, which isolation policy, which mechanisms.

A host without Kubernetes has no node labels, so the policy is a config option (same names and
aliases as the label). Settings come from an optional YAML file, then command-line flags; the
manager records the effective ones in the database so every `qgpu run` and `qgpu status` agrees.

Simulated GPUs are only ever used when asked for (``gpu_backend: simulated``); when NVML fails the
host gets a clear error, never a silent switch to pretend cards.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Mapping

import yaml

from qgpu_runtime.contract.cliflags import printable_problem
from qgpu_runtime.isolation.policy import DEFAULT_POLICY, Policy, parse_policy
from qgpu_runtime.placement import POLICIES as PLACEMENTS
from qgpu_runtime.standalone.store import StoredCard

BACKENDS = ("nvml", "simulated")
MPS_MODES = ("off", "auto", "on")


@dataclass(frozen=True)
class HostConfig:
    """Effective settings of a standalone host.

    mps: ``on`` requires MPS (fixed-share caps by active thread percentage, memory by pinned
    limits), ``auto`` uses it when nvidia-cuda-mps-control is installed, ``off`` never.
    tick_s: control period of the isolation engine.
    memory_tolerance_mib: how far over its quota a job may go before the watchdog stops it
    (NVML counts the CUDA context, a few hundred MiB, against the job).
    """

    node_name: str
    policy: Policy = DEFAULT_POLICY
    placement: str = "binpack"
    gpu_backend: str = "nvml"
    simulated_gpus: str | None = None
    mps: str = "off"
    tick_s: float = 0.05
    memory_tolerance_mib: int = 0

    def __post_init__(self) -> None:
        for key, kind in (("node_name", str), ("placement", str), ("gpu_backend", str), ("mps", str),
                          ("simulated_gpus", (str, type(None)))):
            if not isinstance(getattr(self, key), kind):
                raise ValueError(f"{key}: {getattr(self, key)!r} is not allowed: must be text")
        problem = printable_problem("node_name:", self.node_name)
        if problem:
            raise ValueError(problem)
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement: {self.placement!r} is not allowed: use one of {', '.join(sorted(PLACEMENTS))}")
        if self.gpu_backend not in BACKENDS:
            raise ValueError(f"gpu_backend: {self.gpu_backend!r} is not allowed: use one of {', '.join(BACKENDS)}")
        if self.gpu_backend == "simulated" and not self.simulated_gpus:
            raise ValueError("simulated_gpus: missing: gpu_backend simulated needs a spec such as 2xT4-16G")
        if self.gpu_backend == "nvml" and self.simulated_gpus:
            raise ValueError(f"simulated_gpus: {self.simulated_gpus!r} is not allowed with gpu_backend nvml: "
                             "simulated cards are only used with gpu_backend simulated")
        if self.mps not in MPS_MODES:
            raise ValueError(f"mps: {self.mps!r} is not allowed: use one of {', '.join(MPS_MODES)}")
        if isinstance(self.tick_s, bool) or not isinstance(self.tick_s, (int, float)) or not 0.005 <= self.tick_s <= 5:
            raise ValueError(f"tick_s: {self.tick_s!r} is not allowed: must be 0.005..5 seconds")
        if isinstance(self.memory_tolerance_mib, bool) or not isinstance(self.memory_tolerance_mib, int) or self.memory_tolerance_mib < 0:
            raise ValueError(f"memory_tolerance_mib: {self.memory_tolerance_mib!r} is not allowed: must be >= 0")


_FILE_KEYS = {"node_name", "policy", "placement", "gpu_backend", "simulated_gpus", "mps", "tick_s", "memory_tolerance_mib"}


def load_config(path: str | None, overrides: Mapping[str, Any]) -> HostConfig:
    """File settings (if any), then the non-None ``overrides`` (command-line flags)."""
    values: dict[str, Any] = {}
    if path:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ValueError(f"--config {path!r}: cannot read it: {err}") from err
        if not isinstance(data, dict):
            raise ValueError(f"--config {path!r}: must be a mapping of settings, got {type(data).__name__}")
        unknown = set(data) - _FILE_KEYS
        if unknown:
            raise ValueError(f"--config {path!r}: unknown setting(s) {', '.join(sorted(unknown))}: known are {', '.join(sorted(_FILE_KEYS))}")
        values.update(data)
    if isinstance(values.get("mps"), bool):  # YAML 1.1 reads a bare on/off as a boolean
        values["mps"] = "on" if values["mps"] else "off"
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "policy" in values:
        values["policy"] = parse_policy(str(values["policy"]), field="policy")
    values.setdefault("node_name", socket.gethostname())
    for key, kind in (("tick_s", float), ("memory_tolerance_mib", int)):
        if key in values:
            if isinstance(values[key], bool):
                raise ValueError(f"{key}: {values[key]!r} is not a number")
            try:
                values[key] = kind(values[key])
            except (TypeError, ValueError, OverflowError) as err:
                raise ValueError(f"{key}: {values[key]!r} is not a number") from err
    return HostConfig(**values)


def simulated_cards(option: str, seed: str) -> list[StoredCard]:
    """Cards from the node manager's simulated-GPU option (``2xT4-16G,1xA100-80G`` or a YAML/JSON
    file), with the same stable UUIDs it gives them: one option describes a host both ways."""
    from qgpu_runtime.gpu.simulated import build_cards, specs_from_option

    specs = specs_from_option(option)[0]
    return [StoredCard(c.index, c.uuid, c.model, c.memory_mib) for c in build_cards(specs, seed)]


def nvml_cards() -> list[StoredCard]:
    """The host's real cards; raises NvmlUnavailable with the failing call when NVML cannot answer."""
    from qgpu_runtime.gpu.nvml_lib import list_cards, load_nvml

    return [StoredCard(c.index, c.uuid, c.model, c.memory_mib) for c in list_cards(load_nvml())]


def discover_cards(config: HostConfig) -> list[StoredCard]:
    if config.gpu_backend == "simulated":
        assert config.simulated_gpus is not None
        return simulated_cards(config.simulated_gpus, config.node_name)
    return nvml_cards()
