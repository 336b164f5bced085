"""`qgpu status`: cluster records and store files rendered through the shared view."""

from __future__ import annotations

import json

from podfactory import pod, qgpu

from qgpu_runtime.cli import main
from qgpu_runtime.gpu.simulated import build_cards, parse_spec
from qgpu_runtime.node.nodeinfo import node_metadata
from qgpu_runtime.node.store import Share, Store
from qgpu_runtime.status_cmd import cluster_status, kubectl_main


def node_obj(name, spec="2xT4-16G", policy="fixed-share"):
    labels, notes = node_metadata(build_cards(parse_spec(spec), name), {}, policy)
    return {"metadata": {"name": name, "labels": labels, "annotations": notes}}, build_cards(parse_spec(spec), name)


def test_cluster_status_sums_live_records_per_card():
    n1, cards = node_obj("n1")
    pods = [pod("a", "n1", [("main", qgpu(30, 5), [(0, cards[0].uuid, 300, 5120)])], phase="Running"),
            pod("b", "n1", [("main", qgpu(20, 2), [(0, cards[0].uuid, 200, 2048)])], klass="offline"),
            pod("old", "n1", [("main", qgpu(50, 5), [(1, cards[1].uuid, 500, 5120)])], phase="Succeeded")]
    (status,) = cluster_status([n1], pods)
    assert (status.name, status.policy) == ("n1", "fixed-share")
    c0, c1 = status.cards
    assert (c0.model, c0.memory_mib, c0.core_allocated_milli, c0.memory_allocated_mib) == ("T4", 16384, 500, 7168)
    assert [(w.name, w.klass) for w in c0.workloads] == [("default/a", "normal"), ("default/b", "offline")]
    assert c1.workloads == () and c1.core_allocated_milli == 0


def test_cluster_status_shows_nodes_known_only_from_records():
    p = pod("a", "bare", [("main", qgpu(30, 5), [(0, "GPU-x", 300, 5120)])])
    (status,) = cluster_status([], [p])
    assert (status.name, status.cards[0].model, status.cards[0].uuid) == ("bare", "?", "GPU-x")


def test_with_the_verify_key_unsigned_records_are_marked_and_counted_nowhere():
    from qgpu_runtime.status import render_table
    from tests.recordkeys import VERIFIER

    n1, cards = node_obj("n1")
    pods = [pod("honest", "n1", [("main", qgpu(30, 5), [(0, cards[0].uuid, 300, 5120)])]),
            pod("forged", "n1", [("main", qgpu(10, 1), [(0, cards[0].uuid, 1000, 16384)])], signed=False)]
    (status,) = cluster_status([n1], pods, VERIFIER)
    c0 = status.cards[0]
    assert (c0.core_allocated_milli, c0.memory_allocated_mib) == (300, 5120)
    assert [(w.name, w.unverified) for w in c0.workloads] == [("default/honest", False), ("default/forged", True)]
    assert "default/forged(100%/16384MiB,UNVERIFIED)" in render_table([status])
    (unchecked,) = cluster_status([n1], pods)
    assert unchecked.cards[0].core_allocated_milli == 1300  # without the key: shown as written


def write_store(path):
    s = Store(path)
    cards = build_cards(parse_spec("1xV100-32G"), "host")
    s.sync_cards(cards)
    s.set_meta({"node": "host", "policy": "burst-share"})
    s.record(__import__("qgpu_runtime.node.store", fromlist=["Grant"]).Grant("j1", "", "train", "", "job", ("x",), 1),
             [Share("j1", "", "train", "", 0, cards[0].uuid, 300, 4096, "offline", 1)])
    s.close()


def test_status_json_from_a_store_file(tmp_path, capsys):
    write_store(tmp_path / "meta.db")
    assert main(["status", "--standalone-db", str(tmp_path / "meta.db"), "--json"]) == 0
    (n,) = json.loads(capsys.readouterr().out)["nodes"]
    assert (n["name"], n["policy"]) == ("host", "burst-share")
    assert n["cards"][0]["workloads"] == [{"name": "train", "core_milli": 300, "memory_mib": 4096, "klass": "offline",
                                           "unverified": False, "container": "", "used_core_pct": None,
                                           "used_memory_mib": None}]


def test_kubectl_plugin_table_from_a_store_file(tmp_path, capsys):
    write_store(tmp_path / "meta.db")
    assert kubectl_main(["status", "--standalone-db", str(tmp_path / "meta.db")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["NODE", "POLICY", "CARD"]
    assert "train(30%/4096MiB,offline)" in out[1] and "V100" in out[1]


def test_status_names_a_missing_store(tmp_path, capsys):
    assert main(["status", "--standalone-db", str(tmp_path / "nope.db")]) == 1
    assert "nope.db: no such store file" in capsys.readouterr().err


def test_plain_status_reads_the_store_qgpu_standalone_db_names(tmp_path, capsys, monkeypatch):
    """The standalone host's commands share $QGPU_STANDALONE_DB; plain `qgpu status` reads it too."""
    write_store(tmp_path / "meta.db")
    monkeypatch.setenv("QGPU_STANDALONE_DB", str(tmp_path / "meta.db"))
    assert main(["status", "--json"]) == 0
    (n,) = json.loads(capsys.readouterr().out)["nodes"]
    assert n["cards"][0]["workloads"][0]["name"] == "train"
    monkeypatch.setenv("QGPU_STANDALONE_DB", str(tmp_path / "gone.db"))
    assert main(["status"]) == 1
    assert "gone.db: no such store file" in capsys.readouterr().err


def test_an_explicit_kubeconfig_wins_over_qgpu_standalone_db(tmp_path, capsys, monkeypatch):
    write_store(tmp_path / "meta.db")
    monkeypatch.setenv("QGPU_STANDALONE_DB", str(tmp_path / "meta.db"))
    missing = tmp_path / "no-kubeconfig"
    assert main(["status", "--kubeconfig", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "meta.db" not in err and str(missing) in err, err


def pending(name, resources=None, conditions=None, **spec):
    return {"metadata": {"namespace": "team", "name": name, "annotations": spec.pop("annotations", {})},
            "spec": {"containers": [{"name": "main", "resources": {"limits": resources or {}}}], **spec},
            "status": {"phase": "Pending", "conditions": conditions or []}}


def test_pending_gpu_pods_are_listed_with_the_schedulers_reason():
    from qgpu_runtime.status import render_table
    from qgpu_runtime.status_cmd import pending_gpu_pods

    unschedulable = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": "0/3 nodes are available: 3 qgpu: no card has 60% core free."}]
    pods = [
        pending("big", {"tke.cloud.tencent.com/qgpu-core": "60", "tke.cloud.tencent.com/qgpu-memory": "5"}, unschedulable),
        pending("gated", {"nvidia.com/gpu": "1"}, schedulingGates=[{"name": "example.com/quota"}]),
        pending("new", {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"}),
        pending("kai", {}, schedulerName="kai-scheduler", annotations={"gpu-fraction": "0.5"}),
        pending("claimed", {}, resourceClaims=[{"name": "qgpu-0", "resourceClaimTemplateName": "qgpu-c300-m4096-x1"}]),
        pending("cpu-only-chart", {"nvidia.com/gpu": "0"}, unschedulable),  # zero: no GPU, not listed
        pending("plain", {"cpu": "1"}, unschedulable),
        {**pending("running", {"nvidia.com/gpu": "1"}), "spec": {"nodeName": "n1", "containers": []}},
        {**pending("done", {"nvidia.com/gpu": "1"}), "status": {"phase": "Failed"}},
    ]
    listed = {p.name: p for p in pending_gpu_pods(pods)}
    assert sorted(listed) == ["team/big", "team/claimed", "team/gated", "team/kai", "team/new"]
    assert listed["team/big"].reason == "Unschedulable" and "no card has 60% core free" in listed["team/big"].message
    assert listed["team/big"].asks == "tke.cloud.tencent.com/qgpu-core=60, tke.cloud.tencent.com/qgpu-memory=5"
    assert (listed["team/gated"].reason, listed["team/gated"].message) == ("SchedulingGated", "gates: example.com/quota")
    assert listed["team/new"].reason == "NotTried"
    assert listed["team/kai"].asks == "gpu-fraction=0.5"
    assert listed["team/claimed"].asks == "claim qgpu-c300-m4096-x1"
    table = render_table([], list(listed.values()))
    assert table.splitlines()[2].split()[:4] == ["PENDING", "ASKS", "REASON", "MESSAGE"]
    assert any(line.startswith("team/big") and "Unschedulable" in line for line in table.splitlines())


def test_status_json_carries_the_pending_list_even_when_empty(tmp_path, capsys):
    write_store(tmp_path / "meta.db")
    assert main(["status", "--standalone-db", str(tmp_path / "meta.db"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pending"] == []


# ---- what is used: the manager's /metrics, read through the apiserver's pod proxy ----------------

def manager_metrics_text(node, cards, pods, processes, shares):
    """The /metrics text node/metrics.py renders for these pods, shares and GPU processes."""
    from prometheus_client import CollectorRegistry, generate_latest

    from qgpu_runtime.gpu.types import CardUsage
    from qgpu_runtime.node.metrics import NodeCollector, build_snapshot

    usage = [CardUsage(c.index, sum(p.sm_util_pct for p in processes if p.card_index == c.index),
                       sum(p.memory_mib for p in processes if p.card_index == c.index),
                       tuple(p for p in processes if p.card_index == c.index)) for c in cards]
    collector = NodeCollector(node)
    collector.update(build_snapshot(node, cards, {}, usage, shares, pods))
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def used_fixture():
    from qgpu_runtime.gpu.types import ProcessUsage

    n1, cards = node_obj("n1")
    a = pod("a", "n1", [("main", qgpu(30, 5), [(0, cards[0].uuid, 300, 5120)])], phase="Running",
            container_ids={"main": "c" * 64})
    b = pod("b", "n1", [("w1", qgpu(20, 2), [(0, cards[0].uuid, 200, 2048)]), ("w2", qgpu(20, 2), [(1, cards[1].uuid, 200, 2048)])],
            phase="Running", container_ids={"w1": "d" * 64, "w2": "e" * 64})
    uid_a, uid_b = a["metadata"]["uid"], b["metadata"]["uid"]
    processes = [ProcessUsage(10, 0, 1800, 12, f"0::/kubepods/pod{uid_a}/{'c' * 64}"),
                 ProcessUsage(11, 0, 700, 5, f"0::/kubepods/pod{uid_b}/{'d' * 64}"),
                 ProcessUsage(12, 1, 300, 0, "0::/user.slice/someone")]  # not a pod's: counts on the card only
    shares = [Share("a", "default", "a", "main", 0, cards[0].uuid, 300, 5120, "normal", 1),
              Share("b", "default", "b", "w1", 0, cards[0].uuid, 200, 2048, "normal", 2),
              Share("b", "default", "b", "w2", 1, cards[1].uuid, 200, 2048, "normal", 2)]
    return n1, cards, [a, b], manager_metrics_text("n1", cards, [a, b], processes, shares)


def test_the_used_series_the_manager_writes_are_read_back_per_card_and_container():
    from qgpu_runtime.status import parse_usage

    _, _, _, text = used_fixture()
    other = 'qgpu_container_memory_used_bytes{node="n2",namespace="default",pod="a",container="main",card="0"} 9e9\n'
    usage = parse_usage("n1", text + other)
    assert usage.cards == {0: (17, 2500), 1: (0, 300)}
    assert usage.containers == {("default", "a", "main", 0): (12, 1800), ("default", "b", "w1", 0): (5, 700)}


def test_unusable_samples_are_skipped_and_non_prometheus_text_is_named():
    import pytest

    from qgpu_runtime.status import MAX_METRICS_BYTES, UsageError, parse_usage

    text = ('qgpu_card_memory_used_bytes{node="n1",card="0"} NaN\n'
            'qgpu_card_memory_used_bytes{node="n1",card="64"} 1048576\n'
            'qgpu_card_memory_used_bytes{node="n1",card="-1"} 1048576\n'
            'qgpu_card_utilization_ratio{node="n1",card="1"} -0.5\n'
            'qgpu_card_utilization_ratio{node="n1",card="2"} 0.25\n')
    assert parse_usage("n1", text).cards == {2: (25, None)}
    with pytest.raises(UsageError, match="node n1: the manager's /metrics is not Prometheus text"):
        parse_usage("n1", "<html>proxy error</html>\n")
    with pytest.raises(UsageError, match="over the limit"):
        parse_usage("n1", "#" * (MAX_METRICS_BYTES + 1))


def test_used_is_shown_beside_requested_per_card_and_container():
    from qgpu_runtime.status import parse_usage, render_json, render_table, with_usage

    n1, _, pods, text = used_fixture()
    n2, _ = node_obj("n2")
    nodes = with_usage(cluster_status([n1, n2], pods), {"n1": parse_usage("n1", text), "n2": "forbidden: pods/proxy"})
    first, second = nodes
    c0, c1 = first.cards
    assert (c0.util_pct, c0.memory_used_mib, c1.util_pct, c1.memory_used_mib) == (17, 2500, 0, 300)
    assert [(w.name, w.container, w.used_core_pct, w.used_memory_mib) for w in c0.workloads] == [
        ("default/a", "main", 12, 1800), ("default/b/w1", "w1", 5, 700)]
    assert [(w.name, w.used_core_pct, w.used_memory_mib) for w in c1.workloads] == [("default/b/w2", 0, 0)]  # no process
    assert second.usage_error == "forbidden: pods/proxy" and second.cards[0].memory_used_mib is None
    table = render_table(nodes).splitlines()
    assert table[0].split()[-2:] == ["USED", "WORKLOADS"]
    assert table[1].split()[7] == "17%/2500MiB"
    assert "default/a(30%/5120MiB,used 12%/1800MiB), default/b/w1(20%/2048MiB,used 5%/700MiB)" in table[1]
    assert table[3].split()[7] == "-" and "used" not in table[3]
    assert table[-1] == "usage of n2: forbidden: pods/proxy"
    doc = json.loads(render_json(nodes))["nodes"]
    assert doc[0]["cards"][0]["memory_used_mib"] == 2500 and doc[1]["usage_error"] == "forbidden: pods/proxy"


def manager_pod(name, node, namespace="qgpu-system", phase="Running", port=5678, app="qgpu-manager"):
    return {"metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": app}},
            "spec": {"nodeName": node, "containers": [{"name": "manager", "ports": [{"name": "metrics", "containerPort": port}]}]},
            "status": {"phase": phase}}


def test_only_running_managers_in_the_managers_namespace_are_asked():
    from qgpu_runtime.status_cmd import manager_endpoints

    pods = [manager_pod("m1", "n1"), manager_pod("impostor", "n2", namespace="team"),
            manager_pod("starting", "n3", phase="Pending"), manager_pod("other-app", "n4", app="gpu-manager"),
            {**manager_pod("noport", "n5"), "spec": {"nodeName": "n5", "containers": [{"name": "manager"}]}}]
    assert manager_endpoints(pods, "qgpu-system") == {"n1": [("m1", 5678)]}


def test_each_node_gets_its_figures_or_the_reason_they_are_missing():
    from qgpu_runtime.kube.reader import ApiCallError
    from qgpu_runtime.status_cmd import read_usage

    n1, cards, pods, text = used_fixture()
    asked = []

    class Proxy:
        def pod_proxy_get(self, namespace, pod, port, path, limit):
            asked.append((namespace, pod, port, path))
            if pod == "m2":
                raise ApiCallError('reading metrics of pod qgpu-system/m2: 403 Forbidden: cannot get resource "pods/proxy"',
                                   transient=False)
            return text if pod == "m1" else "not metrics {"

    managers = [manager_pod("m1", "n1"), manager_pod("m2", "n2"), manager_pod("m3", "n3")]
    got = read_usage(Proxy(), ["n1", "n2", "n3", "n4"], [*pods, *managers], "qgpu-system")
    assert got["n1"].cards[0] == (17, 2500)
    assert "pods/proxy" in got["n2"] and "not Prometheus text" in got["n3"]
    assert got["n4"] == "no running qgpu-manager pod with a 'metrics' port on it in namespace qgpu-system"
    assert sorted(asked) == [("qgpu-system", f"m{i}", 5678, "metrics") for i in (1, 2, 3)]
