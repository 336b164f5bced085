"""The trace simulator: faithful replay mechanics, JSON output, clear errors on bad CSVs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qgpu_runtime.placement import CardChoice
from qgpu_runtime.sim.replay import ReplayOptions, arrival_order, replay_arrivals, replay_times
from qgpu_runtime.sim.trace import load_nodes, load_pods
from tests.tracedata import openb_trace_dir

NODES = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
    f"node-{i},32000,131072,{g},{m}\n" for i, (g, m) in enumerate([(4, "T4"), (4, "T4"), (2, "V100M32"), (8, "G2"), (0, "")])
)


def pods_csv(n=60, with_times=True):
    header = "name,cpu_milli,memory_mib,num_gpu,gpu_milli" + (",gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time" if with_times else "")
    rows = [header]
    shapes = [(1, 500), (1, 250), (1, 1000), (2, 1000), (0, 0), (1, 800), (1, 300)]
    for i in range(n):
        g, milli = shapes[i % len(shapes)]
        row = f"pod-{i:04d},{1000 + 500 * (i % 5)},4096,{g},{milli}"
        if with_times:
            spec = "V100M32" if i % 11 == 0 and g else ""
            row += f",{spec},LS,Running,{i * 10},{i * 10 + 300},{i * 10}"
        rows.append(row)
    return "\n".join(rows) + "\n"


@pytest.fixture
def trace(tmp_path):
    nodes = tmp_path / "nodes.csv"
    pods = tmp_path / "pods.csv"
    nodes.write_text(NODES)
    pods.write_text(pods_csv())
    return nodes, pods


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", *args], capture_output=True, text=True, input=stdin)


def test_arrival_order_shuffles_by_seed_and_extends_to_130_percent(trace):
    nodes = load_nodes(trace[0])
    pods = load_pods(trace[1])[:20]  # below capacity, so the order must be extended
    capacity = sum(len(n.cards) for n in nodes) * 1000
    assert sum(p.gpu_request_milli for p in pods) < capacity
    a = arrival_order(pods, 42, capacity, 130)
    assert a == arrival_order(pods, 42, capacity, 130)
    assert a != arrival_order(pods, 43, capacity, 130)
    demand = sum(p.gpu_request_milli for p in a)
    assert demand >= 1.3 * capacity
    assert demand - a[-1].gpu_request_milli < 1.3 * capacity  # stops as soon as the target is reached
    assert sorted(p.name for p in a[: len(pods)]) == sorted(p.name for p in pods)


def test_replay_never_over_allocates_and_counts_failures(trace):
    nodes = load_nodes(trace[0])
    pods = load_pods(trace[1])
    result = replay_arrivals(nodes, pods, "binpack", 42)
    finite = result.alloc_pct_by_bin[~(result.alloc_pct_by_bin != result.alloc_pct_by_bin)]
    assert (finite <= 100.0).all()
    assert result.failed_pods > 0  # 130% of capacity cannot all fit
    assert 0 <= result.unallocated_at(100) <= 100


def test_pod_limit_option_changes_what_fits(trace):
    nodes = load_nodes(trace[0])
    pods = load_pods(trace[1])
    free = replay_arrivals(nodes, pods, "binpack", 1, ReplayOptions())
    limited = replay_arrivals(nodes, pods, "binpack", 1, ReplayOptions(gpu_memory_mib=6000, pod_limit=True))
    assert limited.failed_pods >= free.failed_pods


def test_replay_times_releases_pods_that_leave(trace):
    nodes = load_nodes(trace[0])
    pods = load_pods(trace[1])
    result = replay_times(nodes, pods, "frag")
    assert result.pods == len(pods)
    assert 0 < result.mean_alloc_pct <= result.peak_alloc_pct <= 100


def _first_fit_breaches(trace, card_choice):
    """Shared placements that passed over a lower-index card with room for the pod."""
    nodes = load_nodes(trace[0])
    pods = load_pods(trace[1])
    breaches = []

    def check(event):
        if event.kind != "arrive" or not event.placement.containers or event.placement.containers[0].exclusive:
            return
        state, row = event.state, event.state.index[event.placement.node]
        taken = event.placement.containers[0].shares[0]
        for j in range(int(state.n_cards[row])):
            index = int(state.card_index[row, j])
            if index < taken.index and not state.exclusive[row, j] and state.core_free[row, j] >= taken.core_milli:
                breaches.append((event.key, index, taken.index))

    replay_times(nodes, pods, "binpack", ReplayOptions(card_choice=card_choice), observer=check)
    return breaches


def test_card_choice_first_fit_reaches_the_engine(trace):
    assert _first_fit_breaches(trace, CardChoice.FIRST_FIT) == []
    assert _first_fit_breaches(trace, CardChoice.POLICY)  # binpack's best fit does pass over cards


def test_simulate_card_choice_option(trace):
    out = run_cli("simulate", "--nodes", str(trace[0]), "--pods", str(trace[1]), "--policy", "frag", "--seeds", "1",
                  "--card-choice", "first-fit", "--json", "--workers", "1")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["card_choice"] == "first-fit"
    bad = run_cli("simulate", "--nodes", str(trace[0]), "--pods", str(trace[1]), "--card-choice", "last-fit")
    assert bad.returncode == 2 and "--card-choice" in bad.stderr


def test_simulate_json_has_the_documented_keys(trace):
    out = run_cli("simulate", "--nodes", str(trace[0]), "--pods", str(trace[1]), "--policy", "bestfit,frag", "--seeds", "1-3", "--json", "--workers", "1")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["policy"] for r in rows] == ["bestfit", "frag"]
    for r in rows:
        assert {"policy", "unallocated_gpu_pct_at_100", "unallocated_gpu_pct_at_130", "failed_pods"} <= set(r)
        assert r["seeds"] == [1, 2, 3]
        assert 0 <= r["unallocated_gpu_pct_at_100"] <= 100


def test_simulate_draws_a_plot(trace, tmp_path):
    png = tmp_path / "curve.png"
    out = run_cli("simulate", "--nodes", str(trace[0]), "--pods", str(trace[1]), "--policy", "spread", "--seeds", "1", "--plot", str(png), "--workers", "1")
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_replay_times_json(trace):
    out = run_cli("simulate", "--nodes", str(trace[0]), "--pods", str(trace[1]), "--policy", "binpack", "--replay-times", "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["mode"] == "replay-times" and row["pods"] == 60


def test_optional_columns_may_be_absent(tmp_path, trace):
    pods = tmp_path / "five.csv"
    pods.write_text(pods_csv(with_times=False))
    assert len(load_pods(pods)) == 60
    out = run_cli("simulate", "--nodes", str(trace[0]), "--pods", str(pods), "--replay-times")
    assert out.returncode == 2
    assert "--replay-times needs creation_time for every pod" in out.stderr


@pytest.mark.parametrize("content,message", [
    ("name,cpu_milli,memory_mib,num_gpu\np,1,1,1\n", "pods.csv:1: missing required column(s) gpu_milli"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,abc\n", "pods.csv:2: column gpu_milli: 'abc' is not an integer"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,1500\n", "pods.csv:2: column gpu_milli: 1500 is above 1000 (one card)"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,-5,1,1,500\n", "pods.csv:2: column cpu_milli: -5 is below the minimum 0"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,2,500\n", "pods.csv:2: column gpu_milli: 500 with num_gpu=2: multi-GPU pods take whole cards (1000)"),
])
def test_bad_pod_csv_gives_one_clear_line_and_exit_2(tmp_path, trace, content, message):
    pods = tmp_path / "pods.csv"
    pods.write_text(content)
    out = run_cli("simulate", "--nodes", str(trace[0]), "--pods", str(pods), "--seeds", "1")
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_options_are_usage_errors(trace):
    out = run_cli("simulate", "--nodes", str(trace[0]), "--pods", str(trace[1]), "--policy", "magic")
    assert out.returncode == 2 and "--policy: magic unknown; choose from bestfit, binpack, frag, spread" in out.stderr
    out = run_cli("simulate", "--nodes", str(trace[0]), "--pods", str(trace[1]), "--seeds", "9-3")
    assert out.returncode == 2 and "--seeds: range '9-3' runs backwards" in out.stderr


def test_missing_file_is_a_clear_error(tmp_path, trace):
    out = run_cli("simulate", "--nodes", str(tmp_path / "nope.csv"), "--pods", str(trace[1]))
    assert out.returncode == 2 and "nope.csv: cannot open: No such file or directory" in out.stderr


SHARED = openb_trace_dir()


@pytest.mark.skipif(SHARED is None, reason="the openb trace is not beside the checkout (set QGPU_TRACE_DIR)")
def test_short_replay_of_the_real_trace_runs():
    out = run_cli("simulate", "--nodes", str(SHARED / "openb_node_list_gpu_node.csv"), "--pods", str(SHARED / "openb_pod_list_default.csv"),
                  "--policy", "bestfit", "--seeds", "42", "--json", "--workers", "1")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert 4.0 < row["unallocated_gpu_pct_at_100"] < 12.0
