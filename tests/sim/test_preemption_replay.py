"""`qgpu simulate --preemption`: kube-scheduler's node-level choice against qgpu's card-level one,
replayed with the extender's own victim chooser (issue 25 §4)."""

from __future__ import annotations

import json

import pytest

from qgpu_runtime.cli import main
from qgpu_runtime.placement.state import CardSpec, NodeSpec
from qgpu_runtime.sim.preemption import ARMS, MixError, PriorityMix, replay_preemption, replay_sequence
from qgpu_runtime.sim.trace import TracePod


def node(name: str, cards: int = 2) -> NodeSpec:
    return NodeSpec(name, 64000, 262144, tuple(CardSpec(i, f"{name}-gpu{i}", "T4", 16384) for i in range(cards)))


def pod(name: str, milli: int, cards: int = 1) -> TracePod:
    return TracePod(name, 1000, 1024, cards, milli, None, None, None)


def test_node_level_arithmetic_evicts_a_pod_that_frees_no_usable_card_where_qgpu_evicts_the_two_of_one_card():
    """Two cards, two low-priority 45 % pods on each: a 60 % high-priority pod. kube-scheduler's dry run keeps the
    three earliest (the totals still fit) and evicts one, which leaves 55 % on that card: the pod
    stays pending and the next dry run finds no victim at all. qgpu names both pods of one card."""
    order = [(pod(f"low{i}", 450), False) for i in range(4)] + [(pod("high", 600), True)]
    node_arm = replay_sequence([node("a")], order, "binpack", "node")
    assert (node_arm.high_preempted_in, node_arm.high_pending, node_arm.evicted, node_arm.wasted) == (0, 1, 1, 1)
    for arm in ("extender", "card"):
        result = replay_sequence([node("a")], order, "binpack", arm)
        assert (result.high_preempted_in, result.high_pending, result.evicted, result.wasted) == (1, 0, 2, 0), arm
        assert result.evicted_per_admission == 2.0


def test_a_fragmented_node_is_no_candidate_for_kube_scheduler_but_card_level_search_finds_the_victim():
    """Each card 90 % used by one low-priority pod; a 20 % high-priority pod fits the node's totals, so
    kube-scheduler's dry run finds no victim and never asks the extender: only the card arm helps."""
    order = [(pod("low0", 900), False), (pod("low1", 900), False), (pod("high", 200), True)]
    for arm in ("node", "extender"):
        result = replay_sequence([node("a")], order, "binpack", arm)
        assert (result.high_preempted_in, result.high_pending, result.evicted) == (0, 1, 0), arm
    card = replay_sequence([node("a")], order, "binpack", "card")
    assert (card.high_preempted_in, card.high_pending, card.evicted) == (1, 0, 1)


def test_a_two_card_pod_gets_two_whole_cards_and_high_priority_pods_are_never_evicted():
    order = [(pod("low0", 500), False), (pod("high0", 500), True), (pod("low1", 500), False), (pod("low2", 500), False),
             (pod("big", 1000, cards=2), True)]
    result = replay_sequence([node("a", cards=3)], order, "binpack", "card")
    # high0 shares a card with a low pod: that card can never be freed; the other two cards can
    assert (result.high_preempted_in, result.high_pending) == (1, 0)
    assert result.evicted == 2


def test_the_same_seeds_give_the_same_replay_and_the_mix_is_validated():
    nodes = [node(f"n{i}", cards=4) for i in range(3)]
    pods = [pod(f"p{i}", milli) for i, milli in enumerate([250, 500, 750, 1000, 300, 600] * 4)]
    first = [replay_preemption(nodes, pods, "frag", 42, PriorityMix(0.3, seed=1), arm).to_json() for arm in ARMS]
    again = [replay_preemption(nodes, pods, "frag", 42, PriorityMix(0.3, seed=1), arm).to_json() for arm in ARMS]
    assert [json.dumps({k: v for k, v in r.items() if k != "seconds"}) for r in first] == \
           [json.dumps({k: v for k, v in r.items() if k != "seconds"}) for r in again]
    # every arm sees the same pods, marked the same way
    assert len({(r["high_pods"], r["low_pods"]) for r in first}) == 1
    for r in first:
        assert r["high_placed"] + r["high_preempted_in"] + r["high_pending"] == r["high_pods"]
    assert all(r["evicted"] for r in first), first  # the mix is tight enough that every arm preempts
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(MixError, match="high-priority share must be above 0 and below 1"):
            PriorityMix(bad)


def test_the_cli_prints_one_row_per_arm(tmp_path, capsys):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},64000,262144,4,T4\n" for i in range(3)))
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" +
                    "".join(f"p{i},1000,1024,1,{m}\n" for i, m in enumerate([250, 500, 750, 1000] * 5)))
    code = main(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "frag", "--seeds", "42",
                 "--preemption", "0.3", "--json", "--no-progress"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["arm"] for r in rows] == list(ARMS)
    assert main(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--preemption", "1.5"]) == 2
    assert "--preemption=1.5: the high-priority share must be above 0 and below 1" in capsys.readouterr().err
    assert main(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--preemption", "0.3", "--replay-times"]) == 2
    assert "--preemption and --replay-times: " in capsys.readouterr().err
    assert main(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--preemption", "0.3", "--plot", "x.png"]) == 2
    assert "--preemption and --plot: " in capsys.readouterr().err
