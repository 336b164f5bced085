"""`qgpu simulate` on hostile or broken input: one line naming the file, line, column and rule
(or the flag), exit code 2, no traceback; and no input that makes the run allocate without bound."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from qgpu_runtime.placement.state import CardSpec, NodeSpec
from qgpu_runtime.sim import cli
from qgpu_runtime.sim.replay import ReplayOptions, replay_arrivals, replay_times
from qgpu_runtime.sim.trace import TraceError, TracePod, load_nodes, load_pods

NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model\n"
NODES = NODE_HEADER + "node-0,32000,131072,4,T4\nnode-1,32000,131072,2,V100M32\n"
POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time\n"
PODS = POD_HEADER + "".join(f"pod-{i},1000,4096,1,500,{i * 10},{i * 10 + 100}\n" for i in range(6))


def simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "simulate", *args],
                          capture_output=True, text=True, timeout=120)


def write(tmp_path, name: str, content: str | bytes):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def refused(out: subprocess.CompletedProcess, message: str) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.fixture
def pods(tmp_path):
    return write(tmp_path, "pods.csv", PODS)


@pytest.fixture
def nodes(tmp_path):
    return write(tmp_path, "nodes.csv", NODES)


@pytest.mark.parametrize("mode", [[], ["--replay-times"]])
def test_a_cluster_without_cards_is_refused_naming_the_file(tmp_path, pods, mode):
    no_cards = write(tmp_path, "cpu-only.csv", NODE_HEADER + "node-0,32000,131072,0,\nnode-1,32000,131072,0,T4\n")
    refused(simulate("--nodes", str(no_cards), "--pods", str(pods), "--seeds", "1", "--workers", "1", *mode),
            "cpu-only.csv: no GPU capacity: every node has gpu 0")


def test_the_replays_refuse_a_cluster_without_cards():
    cpu_only = [NodeSpec("node-0", 32000, 131072, ())]
    pod = TracePod("pod-0", 1000, 1024, 0, 0, None, 0, 10)
    with pytest.raises(ValueError, match="no GPU capacity"):
        replay_arrivals(cpu_only, [pod], "frag", 1)
    with pytest.raises(ValueError, match="no GPU capacity"):
        replay_times(cpu_only, [pod], "frag")


@pytest.mark.parametrize("row,message", [
    ("node-0,1000000000000000000000000000000,131072,4,T4",
     "nodes.csv:2: column cpu_milli: '1000000000000000000000000000000' is above the maximum 10000000"),
    ("node-0,10000001,131072,4,T4", "nodes.csv:2: column cpu_milli: 10000001 is above the maximum 10000000"),
    ("node-0,32000,67108865,4,T4", "nodes.csv:2: column memory_mib: 67108865 is above the maximum 67108864"),
    ("node-0,32000,131072,17,T4", "nodes.csv:2: column gpu: 17 is above the maximum 16"),
    ("node-0,32000,131072," + "9" * 5000 + ",T4", "nodes.csv:2: column gpu: '99999999999999999999999999999999'… (5000 characters) is above the maximum 16"),
])
def test_node_numbers_are_bounded(tmp_path, pods, row, message):
    bad = write(tmp_path, "nodes.csv", NODE_HEADER + row + "\n")
    refused(simulate("--nodes", str(bad), "--pods", str(pods), "--seeds", "1", "--workers", "1"), message)


@pytest.mark.parametrize("row,message", [
    ("p,1000000000000000000000000000000,1,1,500,0,1",
     "pods.csv:2: column cpu_milli: '1000000000000000000000000000000' is above the maximum 10000000"),
    ("p,1000,67108865,1,500,0,1", "pods.csv:2: column memory_mib: 67108865 is above the maximum 67108864"),
    ("p,1000,1024,17,1000,0,1", "pods.csv:2: column num_gpu: 17 is above the maximum 16"),
    ("p,1000,1024,1,500,0,9223372036854775808", "pods.csv:2: column deletion_time: 9223372036854775808 is above the maximum 9223372036854775807"),
    ("p,1000,1024,1,500,-" + "1" * 40 + ",1", "pods.csv:2: column creation_time: '-1111111111111111111111111111111'… (41 characters) is below the minimum 0"),
])
def test_pod_numbers_are_bounded(tmp_path, nodes, row, message):
    bad = write(tmp_path, "pods.csv", POD_HEADER + row + "\n")
    refused(simulate("--nodes", str(nodes), "--pods", str(bad), "--seeds", "1", "--workers", "1", "--replay-times"), message)


@pytest.mark.parametrize("spec,message", [
    ("|".join(f"M{i}" for i in range(17)), "pods.csv:2: column gpu_spec: 'M0|M1|M2|M3|M4|M5|M6|M7|M8|M9|M1'… "
     "(57 characters) lists 17 GPU models, the longest of 3 characters; at most 16 of at most 96 (the bound of qgpu.io/gpu-model)"),
    ("T4|" + "V" * 97, "lists 2 GPU models, the longest of 97 characters; at most 16 of at most 96"),
])
def test_a_pods_gpu_models_are_bounded_as_the_request_parser_bounds_them(tmp_path, nodes, spec, message):
    bad = write(tmp_path, "pods.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n" + f"p,1000,1024,1,500,{spec}\n")
    with pytest.raises(TraceError) as info:
        load_pods(bad)
    assert message in str(info.value)
    assert len(load_pods(write(tmp_path, "ok.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
                               + "p,1000,1024,1,500," + "|".join(f"M{i}" for i in range(16)) + "\n"))[0].models) == 16


def test_a_repeated_node_name_is_refused_naming_both_lines(tmp_path, pods):
    bad = write(tmp_path, "nodes.csv", NODES + "node-0,1000,1024,1,T4\n")
    refused(simulate("--nodes", str(bad), "--pods", str(pods), "--seeds", "1", "--workers", "1"),
            "nodes.csv:4: column sn: 'node-0' repeats the node of line 2; node names must be unique")


def test_a_repeated_pod_name_is_refused_naming_both_lines(tmp_path, nodes):
    bad = write(tmp_path, "pods.csv", PODS + "pod-3,1000,4096,1,1000,5,50\n")
    refused(simulate("--nodes", str(nodes), "--pods", str(bad), "--replay-times"),
            "pods.csv:8: column name: 'pod-3' repeats the pod of line 5; pod names must be unique")


def test_replay_times_keeps_two_pods_of_one_name_apart():
    """The first fits and the second never can (more CPU than the node): one failure, not two."""
    node = NodeSpec("node-0", 4000, 16384, (CardSpec(0, "node-0-gpu0", "T4", 16384),))
    fits = TracePod("twin", 1000, 1024, 1, 500, None, 0, 100)
    never = TracePod("twin", 8000, 1024, 1, 500, None, 1, 100)
    assert replay_times([node], [fits, never], "frag").failed_pods == 1


def test_the_bundled_traces_have_unique_names():
    from tests.tracedata import openb_trace_dir

    trace = openb_trace_dir()
    if trace is None:
        pytest.skip("the openb trace is not beside the checkout (set QGPU_TRACE_DIR)")
    assert len(load_nodes(trace / "openb_node_list_gpu_node.csv")) == 1213
    assert len(load_pods(trace / "openb_pod_list_default.csv")) == 8152


@pytest.mark.parametrize("content,message", [
    (NODE_HEADER.encode() + b"node-0,32000,131072,4,T4\nn\xff1,32000,131072,2,T4\n",
     "nodes.csv:3: byte offset 60: 0xff is not UTF-8; trace files must be UTF-8 text"),
    (NODE_HEADER.encode() + b"node-0,32000,131072,4,T4\xc3",
     "nodes.csv:2: byte offset 58: the file ends inside a UTF-8 character"),
    ("s\u00e9,cpu_milli\n".encode("latin-1"), "nodes.csv:1: byte offset 1: 0xe9 is not UTF-8"),
])
def test_a_file_that_is_not_utf8_is_refused_naming_the_byte(tmp_path, pods, content, message):
    bad = write(tmp_path, "nodes.csv", content)
    refused(simulate("--nodes", str(bad), "--pods", str(pods), "--seeds", "1", "--workers", "1"), message)


def test_a_cell_beyond_the_csv_field_limit_is_one_line(tmp_path, nodes):
    bad = write(tmp_path, "pods.csv", POD_HEADER + "p," + "1" * 200_000 + ",1,1,500,0,1\n")
    refused(simulate("--nodes", str(nodes), "--pods", str(bad), "--seeds", "1"),
            "pods.csv:2: not CSV: field larger than field limit")


def test_the_number_of_seeds_is_bounded_before_any_is_listed(tmp_path):
    assert len(cli.parse_seeds("1-1000")) == cli.MAX_SEEDS
    with pytest.raises(cli.UsageError, match="--seeds: '1-1001' names more than 1000 seeds"):
        cli.parse_seeds("1-1001")
    with pytest.raises(cli.UsageError, match="more than 1000 seeds"):
        cli.parse_seeds("1-600,1000-1400")
    # the flag is checked before the files are read (and 0-100000000 the same way, without listing them)
    out = simulate("--nodes", str(tmp_path / "absent.csv"), "--pods", str(tmp_path / "absent.csv"), "--seeds", "0-1000")
    refused(out, "qgpu simulate: --seeds: '0-1000' names more than 1000 seeds")


@pytest.mark.parametrize("workers", ["-3", "257"])
def test_workers_out_of_range_are_refused_naming_the_flag(tmp_path, workers):
    out = simulate("--nodes", str(tmp_path / "absent.csv"), "--pods", str(tmp_path / "absent.csv"), "--workers", workers)
    refused(out, f"qgpu simulate: --workers: {workers} must be between 0 and 256 (0: one per CPU)")


def test_workers_never_outnumber_the_replays():
    assert cli.worker_count(64, 2) == 2
    assert cli.worker_count(3, 10) == 3
    assert cli.worker_count(0, 1) == 1  # 0: one per CPU, still no more than the replays


@pytest.fixture
def recorded_bars(monkeypatch):
    bars: list[cli._Progress] = []

    class Recorded(cli._Progress):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(cli, "_Progress", Recorded)
    return bars


def test_progress_of_several_seeds_counts_seeds(nodes, pods, recorded_bars):
    cli._run_arrivals(load_nodes(nodes), load_pods(pods), ["frag", "binpack"], [1, 2], ReplayOptions(), 1, True)
    [bar] = recorded_bars
    assert (bar.unit, bar.total, bar.count) == ("seed", 4, 4)


def test_progress_of_one_seed_counts_its_pods(nodes, pods, recorded_bars):
    [summary] = cli._run_arrivals(load_nodes(nodes), load_pods(pods), ["frag"], [1], ReplayOptions(), 1, True)
    [bar] = recorded_bars
    assert (bar.unit, bar.total) == ("pod", None)  # the replay extends the pods as it goes
    assert bar.count == summary.pods > len(load_pods(pods))


def test_reading_the_trace_is_announced_on_a_terminal(nodes, pods, capsys, monkeypatch):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--nodes", str(nodes), "--pods", str(pods), "--seeds", "1", "--workers", "1", "--json"])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.run(args) == 0
    assert f"qgpu simulate: reading {nodes} and {pods}" in capsys.readouterr().err


def test_a_reader_that_left_ends_the_command_quietly(tmp_path):
    """`qgpu simulate … | head -1`: the reader closed the pipe before the answer was written; before,
    a BrokenPipeError traceback (twice: again at the interpreter's flush at exit)."""
    nodes, pods = write(tmp_path, "nodes.csv", NODES), write(tmp_path, "pods.csv", PODS)
    proc = subprocess.Popen([sys.executable, "-m", "qgpu_runtime.cli", "simulate", "--nodes", str(nodes),
                             "--pods", str(pods), "--seeds", "42", "--json", "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before a byte is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err
