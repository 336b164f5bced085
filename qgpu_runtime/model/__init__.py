"""The canonical request model: what a pod asks for, whatever dialect it speaks."""

from qgpu_runtime.model.requests import (
    DEFAULT_LIMITS,
    AppClass,
    CardLimits,
    ContainerRequest,
    Dialect,
    PodRequest,
    Problem,
    RequestError,
    parse_pod,
)

__all__ = [
    "DEFAULT_LIMITS",
    "AppClass",
    "CardLimits",
    "ContainerRequest",
    "Dialect",
    "PodRequest",
    "Problem",
    "RequestError",
    "parse_pod",
]
