"""The time-ordered replay (`--replay-times`: pods arrive and leave) never over-books a card.

A ledger independent of ClusterState's arrays adds up, after every event, what the placements
the replay reports put on each card and node, and checks it against the trace's capacities (and
that the state's own free counts agree). On the full openb cluster the trace's demand peaks at
about 1 % of the GPUs, so nothing would ever compete; the cut keeps every 96th node (13 nodes,
58 GPUs), where demand peaks above capacity and every policy turns pods away.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from qgpu_runtime.placement.state import CORE_MILLI_PER_CARD, ClusterState, Placement
from qgpu_runtime.sim.replay import ReplayEvent, ReplayOptions, replay_times
from qgpu_runtime.sim.trace import load_nodes, load_pods
from tests.tracedata import openb_trace_dir

TRACE = openb_trace_dir()
NODE_STRIDE = 96
# GPU memory per sharing pod and the per-card pod limit on, so every capacity the state keeps is at stake
OPTIONS = ReplayOptions(gpu_memory_mib=6000, pod_limit=True)


class CapacityLedger:
    """Observer of a replay: books and releases each reported placement, checks every touched
    card and node right after each event, and counts events by kind."""

    def __init__(self, state_nodes):
        self.nodes = {n.name: n for n in state_nodes}
        self.core = defaultdict(int)
        self.memory = defaultdict(int)
        self.shared = defaultdict(int)
        self.whole = defaultdict(int)
        self.cpu = defaultdict(int)
        self.node_memory = defaultdict(int)
        self.kinds = defaultdict(int)
        self.last_time = None

    def __call__(self, event: ReplayEvent) -> None:
        assert self.last_time is None or event.time >= self.last_time, f"{event.key}: time went back to {event.time}"
        self.last_time = event.time
        self.kinds[event.kind] += 1
        if event.placement is None:
            assert event.kind in ("fail", "leave"), f"{event.key}: {event.kind} without a placement"
            return
        self._book(event.placement, +1 if event.kind == "arrive" else -1)
        self._check(event.key, event.placement, event.state)

    def _book(self, placement: Placement, sign: int) -> None:
        node = placement.node
        self.cpu[node] += sign * placement.cpu_milli
        self.node_memory[node] += sign * placement.memory_mib
        for container in placement.containers:
            for share in container.shares:
                card = (node, share.index)
                if container.exclusive:
                    self.whole[card] += sign
                else:
                    self.core[card] += sign * share.core_milli
                    self.memory[card] += sign * share.memory_mib
                    self.shared[card] += sign

    def _check(self, key: str, placement: Placement, state: ClusterState) -> None:
        node = self.nodes[placement.node]
        assert self.cpu[node.name] <= node.cpu_milli and self.node_memory[node.name] <= node.memory_mib, \
            f"{key}: node {node.name} over-booked: cpu {self.cpu[node.name]}/{node.cpu_milli}"
        row = state.index[node.name]
        for container in placement.containers:
            for share in container.shares:
                card = (node.name, share.index)
                spec = node.cards[share.index]
                slot = state.slot_of(row, share.index)
                where = f"{key}: card {share.index} of {node.name}"
                assert self.whole[card] in (0, 1) and not (self.whole[card] and self.shared[card]), \
                    f"{where}: {self.whole[card]} whole-card holders beside {self.shared[card]} shares"
                assert self.core[card] <= CORE_MILLI_PER_CARD, f"{where}: core {self.core[card]} of {CORE_MILLI_PER_CARD}"
                assert self.memory[card] <= spec.memory_mib, f"{where}: memory {self.memory[card]} of {spec.memory_mib} MiB"
                assert self.shared[card] <= state.pod_limit[row, slot], f"{where}: {self.shared[card]} shares"
                assert state.core_free[row, slot] == CORE_MILLI_PER_CARD - self.core[card], f"{where}: state disagrees"


@pytest.fixture(scope="module")
def cut():
    if TRACE is None:
        pytest.skip("the openb trace is not beside the checkout (set QGPU_TRACE_DIR)")
    nodes = load_nodes(TRACE / "openb_node_list_gpu_node.csv", gpu_memory=True)[::NODE_STRIDE]
    return nodes, load_pods(TRACE / "openb_pod_list_default.csv")


@pytest.mark.parametrize("policy", ["bestfit", "binpack", "spread", "frag"])
def test_no_card_is_ever_over_booked_while_pods_come_and_go(cut, policy):
    nodes, pods = cut
    ledger = CapacityLedger(nodes)
    result = replay_times(nodes, pods, policy, OPTIONS, observer=ledger)
    assert ledger.kinds["arrive"] + ledger.kinds["fail"] == len(pods)
    assert ledger.kinds["fail"] == result.failed_pods > 0  # the cut does contend for cards
    assert ledger.kinds["leave"] > 0 and result.peak_alloc_pct <= 100


def test_the_ledger_catches_a_card_booked_beyond_capacity(cut):
    """The check can fail: two halves and a bit more of one card, reported as placed."""
    from qgpu_runtime.placement.state import CardShare, ContainerPlacement

    nodes, _ = cut
    node = next(n for n in nodes if n.cards)
    state = ClusterState(nodes)
    ledger = CapacityLedger(nodes)
    def share(milli):
        return Placement(node.name, (ContainerPlacement("c", (CardShare(0, node.cards[0].uuid, milli, 0),)),))

    state.commit("a", share(600))
    ledger(ReplayEvent(0, "arrive", "a", share(600), state))
    with pytest.raises(AssertionError, match="core 1100 of 1000"):
        ledger(ReplayEvent(1, "arrive", "b", share(500), state))
