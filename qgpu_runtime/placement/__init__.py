"""The placement engine: pure, numpy-backed, shared by the extender, the simulator and `qgpu run`."""

from qgpu_runtime.placement.engine import CardChoice, Unschedulable, check_nodes, place, score
from qgpu_runtime.placement.policies import POLICIES, FragPolicy, Policy, WorkloadShapes, make_policy
from qgpu_runtime.placement.state import (
    CardShare,
    CardSpec,
    ClusterState,
    ContainerPlacement,
    NodeSpec,
    Placement,
    StateError,
)

__all__ = [
    "POLICIES",
    "CardChoice",
    "CardShare",
    "CardSpec",
    "ClusterState",
    "ContainerPlacement",
    "FragPolicy",
    "NodeSpec",
    "Placement",
    "Policy",
    "StateError",
    "Unschedulable",
    "WorkloadShapes",
    "check_nodes",
    "make_policy",
    "place",
    "score",
]
