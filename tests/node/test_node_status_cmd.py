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
                                           "unverified": False}]


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
