"""The GPU-model variant of a trace: who gets a requirement, which one, and that none is impossible."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from qgpu_runtime.placement.state import CardSpec, NodeSpec
from qgpu_runtime.sim.trace import TracePod
from qgpu_runtime.sim.variants import PRODUCTION_FRACTION, PRODUCTION_SPECS, VariantError, pod_kind, with_gpu_spec

MODELS = ("T4", "G2", "P100", "V100M16", "V100M32", "G3", "A10")


def cluster(cpu=96000):
    return [NodeSpec(f"{m}-{i}", cpu, 512 * 1024, tuple(CardSpec(j, f"{m}-{i}-{j}", m, 16384) for j in range(8)))
            for m in MODELS for i in range(2)]


def pods(n=6000):
    shapes = [(1, 300), (1, 1000), (8, 1000), (0, 0), (1, 650)]
    return [TracePod(f"p{i:05d}", 4000, 8192, *shapes[i % len(shapes)], None, None, None) for i in range(n)]


def test_the_share_of_constrained_pods_follows_each_kind_of_pod():
    out = with_gpu_spec(pods(), cluster(), PRODUCTION_FRACTION, seed=1)
    for kind in ("sharing", "whole", "multi"):
        of_kind = [p for p in out if pod_kind(p) == kind]
        total, specs = PRODUCTION_SPECS[kind]
        expected = sum(specs.values()) / total
        share = sum(p.models is not None for p in of_kind) / len(of_kind)
        assert share == pytest.approx(expected, abs=0.05), kind
    assert all(p.models is None for p in out if not p.num_gpu)  # CPU-only pods ask for no model


def test_requirements_are_drawn_from_the_kinds_own_requirements():
    out = with_gpu_spec(pods(), cluster(), PRODUCTION_FRACTION, seed=2)
    sharing = Counter("|".join(sorted(p.models)) for p in out if p.models and pod_kind(p) == "sharing")
    assert set(sharing) <= {"|".join(sorted(s.split("|"))) for s in PRODUCTION_SPECS["sharing"][1]}
    assert sharing.most_common(1)[0][0] == "T4"  # as in production: sharing pods mostly ask for T4


def test_fraction_scales_and_the_draw_is_deterministic():
    base = pods()
    half = with_gpu_spec(base, cluster(), PRODUCTION_FRACTION / 2, seed=3)
    full = with_gpu_spec(base, cluster(), PRODUCTION_FRACTION, seed=3)
    assert with_gpu_spec(base, cluster(), PRODUCTION_FRACTION, seed=3) == full
    count = lambda ps: sum(p.models is not None for p in ps)  # noqa: E731
    assert count(half) == pytest.approx(count(full) / 2, rel=0.15)
    assert count(with_gpu_spec(base, cluster(), 0.0, seed=3)) == 0


def test_no_pod_gets_a_requirement_no_node_can_meet():
    # Only the G2 nodes have the CPU for these pods: every requirement drawn must include G2, or
    # the pod stays unconstrained; none becomes impossible.
    nodes = [n if n.cards[0].model == "G2" else NodeSpec(n.name, 1000, n.memory_mib, n.cards) for n in cluster()]
    out = with_gpu_spec(pods(), nodes, PRODUCTION_FRACTION, seed=4)
    assert any(p.models for p in out)
    assert all("G2" in p.models for p in out if p.models)


def test_a_fraction_outside_zero_to_one_is_refused():
    with pytest.raises(VariantError, match=r"--gpu-spec-fraction: 1.5 must be between 0 and 1"):
        with_gpu_spec(pods(10), cluster(), 1.5, seed=0)


def test_the_cli_refuses_a_bad_fraction_in_one_line(tmp_path):
    nodes = tmp_path / "n.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,65536,2,T4\n")
    trace = tmp_path / "p.csv"
    trace.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,1024,1,500\n")
    out = subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "simulate", "--nodes", str(nodes), "--pods", str(trace),
                          "--gpu-spec-fraction", "-0.1"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == "qgpu simulate: --gpu-spec-fraction: -0.1 must be between 0 and 1"
