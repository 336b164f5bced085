"""bench/fgd_emulation.py: FGD's measure learns online, or counts every pod of the list once and
then stops counting (foreknowledge)."""

from __future__ import annotations

from bench.fgd_emulation import FrozenShapes, fgd_policy, fgd_shapes
from qgpu_runtime.placement.policies import WorkloadShapes
from qgpu_runtime.sim.trace import TracePod


def _pod(name: str, num_gpu: int, gpu_milli: int, cpu_milli: int = 4000) -> TracePod:
    return TracePod(name, cpu_milli, 8192, num_gpu, gpu_milli, None, None, None)


PODS = [_pod("a", 1, 500), _pod("b", 1, 500), _pod("c", 8, 1000, 96000), _pod("d", 0, 0)]


def test_foreknowledge_counts_every_pod_once_then_stops_counting():
    shapes = fgd_shapes(PODS, 0)
    assert isinstance(shapes, FrozenShapes) and shapes.frozen
    assert shapes.total == 4 and sorted(shapes.counts.values()) == [1, 1, 2]
    shapes.observe(PODS[0].request(0))  # what the replay would add as pods arrive
    assert shapes.total == 4


def test_online_shapes_start_empty_and_learn():
    shapes = fgd_shapes(None, 0)
    assert type(shapes) is WorkloadShapes and shapes.total == 0
    shapes.observe(PODS[2].request(0))
    assert shapes.total == 1


def test_the_policy_is_fgds_measure_without_qgpus_extra_terms():
    policy = fgd_policy(fgd_shapes(PODS, 0))
    assert (policy.tie_weight, policy.cpu_balance, policy.model_pressure) == (0, 0, False)
    assert policy.shapes.weigh == "pods" and policy.shapes.coverage == 1.0
