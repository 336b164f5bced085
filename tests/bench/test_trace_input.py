"""bench/trace_input.py: the replay benchmarks' trace and mix options."""

from __future__ import annotations

import argparse

import pytest

from bench.trace_input import add_trace_arguments, load_trace
from qgpu_runtime.sim.trace import load_pods
from qgpu_runtime.sim.variants import with_demand_share
from tests.tracedata import openb_trace_dir


def _parser(sharing: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench")
    add_trace_arguments(parser, sharing)
    return parser


def test_one_mix_at_a_time(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--multi-card-fraction", "0.3", "--sharing-fraction", "0.4"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_benchmark_without_sharing_mixes_does_not_offer_them(capsys):
    with pytest.raises(SystemExit):
        _parser(sharing=False).parse_args(["--sharing-fraction", "0.4"])
    assert "unrecognized arguments: --sharing-fraction" in capsys.readouterr().err
    assert _parser(sharing=False).parse_args([]).variant_seed == 0


@pytest.mark.skipif(openb_trace_dir() is None, reason="the openb trace is not beside the checkout (set QGPU_TRACE_DIR)")
@pytest.mark.parametrize("kind, option", [("multi", "--multi-card-fraction"), ("sharing", "--sharing-fraction")])
def test_the_mix_is_the_one_qgpu_simulate_draws(kind, option):
    parser = _parser()
    nodes, pods = load_trace(parser, parser.parse_args([option, "0.4", "--variant-seed", "2"]))
    trace = openb_trace_dir()
    expected = with_demand_share(load_pods(trace / "openb_pod_list_default.csv"), kind, 0.4, 2)
    assert nodes and sorted(p.name for p in pods) == sorted(p.name for p in expected)


def test_a_missing_trace_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr("bench.trace_input.openb_trace_dir", lambda: None)
    parser = _parser()
    with pytest.raises(SystemExit):
        load_trace(parser, parser.parse_args([]))
    assert "the bundled trace was not found" in capsys.readouterr().err
