"""The workload-mix variants (issue 27): a share of the GPU demand from multi-card pods, or from
pods sharing one card, drawn from the trace."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qgpu_runtime.sim.trace import TracePod
from qgpu_runtime.sim.variants import VariantError, demand_share, pod_kind, with_demand_share


def pods(n=2000):
    # shares of a card, one whole card, 2/4/8 whole cards, CPU only
    shapes = [(1, 200), (1, 500), (1, 1000), (1, 1000), (2, 1000), (4, 1000), (8, 1000), (0, 0)]
    return [TracePod(f"p{i:05d}", 4000, 8192, *shapes[i % len(shapes)], None, None, None) for i in range(n)]


@pytest.mark.parametrize("kind", ["multi", "sharing"])
@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_the_share_of_demand_is_the_one_asked_and_the_pod_count_is_kept(kind, fraction):
    base = pods()
    out = with_demand_share(base, kind, fraction, seed=1)
    assert len(out) == len(base)
    assert sum(not p.num_gpu for p in out) == sum(not p.num_gpu for p in base)  # CPU-only pods kept
    assert len({p.name for p in out}) == len(out)  # copies are renamed
    assert demand_share(out, kind) == pytest.approx(fraction, abs=0.04)


def test_the_draw_is_deterministic_and_depends_on_the_seed():
    base = pods()
    assert with_demand_share(base, "multi", 0.4, seed=3) == with_demand_share(base, "multi", 0.4, seed=3)
    assert with_demand_share(base, "multi", 0.4, seed=3) != with_demand_share(base, "multi", 0.4, seed=4)


def test_pods_are_drawn_from_the_trace_only():
    base = pods()
    shapes = {(p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli) for p in base}
    out = with_demand_share(base, "multi", 0.9, seed=2)
    assert {(p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli) for p in out} <= shapes
    assert sum(pod_kind(p) == "multi" for p in out) > sum(pod_kind(p) == "multi" for p in base)


@pytest.mark.parametrize("kind,flag", [("multi", "--multi-card-fraction"), ("sharing", "--sharing-fraction")])
@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_a_fraction_outside_zero_to_one_is_refused(kind, flag, fraction):
    with pytest.raises(VariantError, match=rf"^{flag}: {fraction} must be between 0 and 1"):
        with_demand_share(pods(10), kind, fraction, seed=0)


def test_a_mix_the_trace_cannot_give_is_refused():
    no_multi = [p for p in pods(100) if pod_kind(p) != "multi"]
    with pytest.raises(VariantError, match=r"^--multi-card-fraction: 0.3 asks for multi pods, but the trace has none"):
        with_demand_share(no_multi, "multi", 0.3)
    only_sharing = [p for p in pods(100) if pod_kind(p) == "sharing"]
    with pytest.raises(VariantError, match=r"^--sharing-fraction: 0.5 asks for other GPU pods"):
        with_demand_share(only_sharing, "sharing", 0.5)


def _simulate(tmp_path, *args):
    nodes = tmp_path / "n.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,65536,8,T4\n")
    trace = tmp_path / "p.csv"
    trace.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,1024,1,500\np2,1000,1024,4,1000\n")
    return subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "simulate", "--nodes", str(nodes), "--pods", str(trace),
                           "--seeds", "1", "--workers", "1", *args], capture_output=True, text=True)


def test_the_cli_refuses_a_bad_fraction_in_one_line(tmp_path):
    out = _simulate(tmp_path, "--multi-card-fraction", "2")
    assert out.returncode == 2
    assert out.stderr.strip() == "qgpu simulate: --multi-card-fraction: 2.0 must be between 0 and 1 (a share of the GPU demand)"
    out = _simulate(tmp_path, "--multi-card-fraction", "0.3", "--sharing-fraction", "0.3")
    assert out.returncode == 2
    assert out.stderr.strip() == "qgpu simulate: --multi-card-fraction and --sharing-fraction: give one of them, not both"


def test_the_cli_replays_a_mix(tmp_path):
    out = _simulate(tmp_path, "--sharing-fraction", "0.6", "--variant-seed", "2", "--json", "--policy", "frag")
    assert out.returncode == 0, out.stderr
    assert '"policy": "frag"' in out.stdout
