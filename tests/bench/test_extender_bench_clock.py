"""The extender benchmark's clock of record: kube-scheduler's own log of each bind (2026-11-29: the
benchmark's watch, closed by a saturated kube-apiserver, had timed 161 of 300 binds two seconds late)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.extender_bench import WATCHER_CLOSED, bind_times, count_lines


def _bound(clock: str, pod: str) -> str:
    return (f'I1129 {clock}    5727 schedule_one.go:483] "Successfully bound pod to node" pod="{pod}" '
            'node="node-00029" evaluatedNodes=100 feasibleNodes=72')


def test_bind_times_are_the_namespaces_binds_to_the_microsecond(tmp_path: Path) -> None:
    log = tmp_path / "kube-scheduler.log"
    log.write_text("\n".join([
        'I1129 07:07:36.365601    5727 node_tree.go:65] "Added node to NodeTree" node="node-00004" zone=""',
        _bound("07:07:36.527192", "bench-1/p00093"),
        _bound("07:07:36.527408", "other/p00001"),  # another namespace: not this arm's
        _bound("07:07:36.970001", "bench-1/p00002"),
        'E1129 07:07:37.474713    5727 run.go:72] "command failed" err="finished without leader elect"',
    ]) + "\n")
    times = bind_times(log, "bench-1")
    assert len(times) == 2
    assert abs((times[1] - times[0]) - 0.442809) < 1e-9
    assert bind_times(log, "bench-") == []  # the namespace matches whole, not as a prefix


def test_bind_times_go_on_past_midnight(tmp_path: Path) -> None:
    log = tmp_path / "kube-scheduler.log"
    log.write_text(_bound("23:59:59.900000", "ns/a") + "\n" + _bound("00:00:00.100000", "ns/b") + "\n")
    times = bind_times(log, "ns")
    assert abs((times[1] - times[0]) - 0.2) < 1e-9


def test_a_missing_log_has_no_binds_and_no_closed_watchers(tmp_path: Path) -> None:
    assert bind_times(tmp_path / "absent.log", "ns") == []
    assert count_lines(tmp_path / "absent.log", WATCHER_CLOSED) == 0


def test_closed_watchers_are_counted_from_kube_apiservers_log(tmp_path: Path) -> None:
    log = tmp_path / "kube-apiserver.log"
    log.write_text(
        'I1129 07:09:15.400175    6325 cache_watcher.go:214] Forcing pods watcher close due to unresponsiveness: '
        'key: "/pods/", labels: "", fields: "", len(c.input) = 10, len(c.result) = 10, graceful = false\n'
        'I1129 07:09:15.400517    6325 cacher.go:494] "cacher initialized" group="policy"\n')
    assert count_lines(log, WATCHER_CLOSED) == 1


def test_http2_comparison_is_summarised_per_arm_and_paired_per_round():
    from bench.extender_bench import http2_summary

    def arm(rate: float, cpu: float, own: str, connections: float) -> dict:
        return {"pods_per_s": rate, "net_cpu_ms_per_pod": {"all": cpu, own: cpu / 3},
                "time_split": {"extender_connections": connections}}

    rounds = [
        {"without_extender": {"pods_per_s": 600.0}, "qgpu_http2": arm(180, 12, "qgpu-extender", 1),
         "qgpu_http1": arm(150, 15, "qgpu-extender", 100), "null_http2": arm(240, 9, "null-extender", 1),
         "null_http1": arm(200, 10, "null-extender", 90)},
        {"without_extender": {"pods_per_s": 400.0}, "qgpu_http2": arm(120, 12, "qgpu-extender", 2),
         "qgpu_http1": arm(120, 15, "qgpu-extender", 96)},
    ]
    summary = http2_summary(rounds)
    assert summary["qgpu_http2"]["pods_per_s"] == 150.0
    assert summary["qgpu_http2"]["ratio_to_baseline"] == 0.3  # (180/600 + 120/400) / 2
    assert summary["qgpu_http2"]["connections"] == [1, 2]
    assert summary["qgpu_http2"]["cpu_ms_per_pod_extender"] == 4.0
    assert summary["qgpu_http2_over_http1"] == [1.2, 1.0]  # paired within each round
    assert summary["null_http2_over_http1"] == [1.2]  # the second round has no null arms
    assert summary["null_http1"]["pods_per_s"] == 200.0


def test_a_comparison_with_another_checkout_is_paired_per_round():
    from bench.extender_bench import source_summary

    def arm(rate: float, own_cpu: float) -> dict:
        return {"pods_per_s": rate, "net_cpu_ms_per_pod": {"all": 3 * own_cpu, "qgpu-extender": own_cpu}}

    rounds = [
        {"without_extender": {"pods_per_s": 500.0}, "qgpu": arm(150, 4.0), "source": arm(125, 5.0)},
        {"without_extender": {"pods_per_s": 300.0}, "source": arm(90, 6.0), "qgpu": arm(90, 4.8)},
        {"without_extender": {"pods_per_s": 400.0}, "qgpu": arm(100, 4.4)},  # a round cut short: no pair
    ]
    summary = source_summary(rounds)
    assert summary["qgpu_over_source_pods_per_s"] == [1.2, 1.0]
    assert summary["qgpu_over_source_extender_cpu"] == [0.8, 0.8]
    assert summary["qgpu"]["pods_per_s"] == 113.3 and summary["qgpu"]["cpu_ms_per_pod_extender"] == 4.4
    assert summary["source"]["ratio_to_baseline"] == 0.275  # (125/500 + 90/300) / 2


@pytest.mark.parametrize("argv, rule", [
    (["--compare-source", "/nonexistent"], "not a checkout of this project"),
    (["--compare-source", "."], "is this checkout"),
    (["--compare-source", "{other}", "--rounds", "0"], "--rounds must be >= 1"),
    (["--compare-source", "{other}", "--compare-http2", "2"], "runs alone"),
])
def test_a_comparison_source_that_cannot_be_compared_is_refused_before_anything_starts(argv, rule, tmp_path, monkeypatch, capsys):
    import sys

    from bench import extender_bench

    other = tmp_path / "other"
    (other / "qgpu_runtime").mkdir(parents=True)
    (other / "qgpu_runtime" / "cli.py").write_text("")
    monkeypatch.chdir(extender_bench.ROOT)
    monkeypatch.setattr(extender_bench, "new_plane", lambda prefix: pytest.fail("a control plane was started"))
    monkeypatch.setattr(sys, "argv", ["extender_bench.py", *(a.replace("{other}", str(other)) for a in argv)])
    with pytest.raises(SystemExit) as exited:
        extender_bench.main()
    assert exited.value.code == 2 and rule in capsys.readouterr().err
