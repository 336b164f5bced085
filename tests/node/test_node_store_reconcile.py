"""The SQLite store and start-up reconciliation."""

from __future__ import annotations

import json

from podfactory import pod, qgpu

from qgpu_runtime.gpu.simulated import build_cards, parse_spec
from qgpu_runtime.node.podresources import HeldDevices
from qgpu_runtime.node.reconcile import plan
from qgpu_runtime.node.store import Grant, Share, Store

CORE = "tke.cloud.tencent.com/qgpu-core"


def grant(uid, name, ids, container="main"):
    return Grant(uid, "default", name, container, CORE, tuple(ids), 1)


def share(uid, name, card=0, container="main"):
    return Share(uid, "default", name, container, card, f"GPU-{card}", 300, 5120, "normal", 1)


def test_store_is_wal_and_survives_reopen(tmp_path):
    s = Store(tmp_path / "m.db")
    s.sync_cards(build_cards(parse_spec("2xT4-16G"), "n"))
    s.record(grant("u1", "a", ["qgpu-core-0-1", "qgpu-core-0-0"]), [share("u1", "a")])
    s.close()
    s = Store(tmp_path / "m.db")
    assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert s.grants()[0].device_ids == ("qgpu-core-0-0", "qgpu-core-0-1")
    assert [c.model for c, _ in s.cards()] == ["T4", "T4"]
    assert s.integrity() == "ok"


def test_shares_are_written_once_per_container_and_released_with_the_last_grant(tmp_path):
    s = Store(tmp_path / "m.db")
    s.record(grant("u1", "a", ["qgpu-core-0-0"]), [share("u1", "a")])
    s.record(Grant("u1", "default", "a", "main", "mem", ("qgpu-memory-0-0",), 2), [share("u1", "a")])
    assert len(s.shares()) == 1
    s.release_grant("u1", "main", CORE)
    assert len(s.shares()) == 1
    s.release_grant("u1", "main", "mem")
    assert s.shares() == [] and s.grants() == []


def test_reassign_swaps_two_containers_cleanly(tmp_path):
    s = Store(tmp_path / "m.db")
    s.record(grant("ua", "a", ["d1"]), [share("ua", "a", card=0)])
    s.record(grant("ub", "b", ["d2"]), [share("ub", "b", card=1)])
    s.reassign({("ua", "main", CORE): ("ub", "default", "b", "main"), ("ub", "main", CORE): ("ua", "default", "a", "main")})
    assert {(g.pod, g.device_ids) for g in s.grants()} == {("b", ("d1",)), ("a", ("d2",))}
    assert {(x.workload, x.card_index) for x in s.shares()} == {("b", 0), ("a", 1)}


def test_reconcile_releases_deleted_and_finished_pods():
    alive = pod("alive", "n", [("main", qgpu(30, 5), [(0, "GPU-0", 300, 5120)])], phase="Running")
    done = pod("done", "n", [("main", qgpu(30, 5), [(0, "GPU-0", 300, 5120)])], phase="Succeeded")
    uid = lambda p: p["metadata"]["uid"]  # noqa: E731
    grants = [grant(uid(alive), "alive", ["x"]), grant(uid(done), "done", ["y"]), grant("gone", "gone", ["z"])]
    p = plan(grants, [], [alive, done], None)
    assert p.release_pods == {uid(done): "pod phase is Succeeded", "gone": "pod no longer exists on this node"}
    assert json.loads(p.annotate[("default", "alive")]) == ["main"]


def test_reconcile_with_pod_resources_drops_grants_kubelet_never_took_and_moves_swapped_ones():
    a = pod("a", "n", [("main", qgpu(30, 5), [(0, "GPU-0", 300, 5120)])], phase="Running")
    b = pod("b", "n", [("main", qgpu(30, 5), [(1, "GPU-1", 300, 5120)])], phase="Running")
    c = pod("c", "n", [("main", qgpu(30, 5), [(1, "GPU-1", 300, 5120)])], phase="Running")
    ua, ub, uc = (p["metadata"]["uid"] for p in (a, b, c))
    grants = [grant(ua, "a", ["d1"]), grant(ub, "b", ["d2"]), grant(uc, "c", ["d3"])]
    held = [HeldDevices("default", "a", "main", CORE, frozenset({"d2"})),
            HeldDevices("default", "b", "main", CORE, frozenset({"d1"})),
            HeldDevices("default", "c", "main", CORE, frozenset({"d9"}))]
    p = plan(grants, [], [a, b, c], held)
    assert p.reassign == {(ua, "main", CORE): ("default", "b", "main"), (ub, "main", CORE): ("default", "a", "main")}
    assert list(p.release_grants) == [(uc, "main", CORE)]
