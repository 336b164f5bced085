"""The Allocate matching rule, pure."""

from __future__ import annotations

import json

import pytest
from podfactory import pod, qgpu

from qgpu_runtime.contract.record import RecordError, parse_record
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model.requests import percent_share_memory_mib
from qgpu_runtime.node.deviceplugin.matching import NoMatch, examine, match, preferred_devices
from qgpu_runtime.node.deviceplugin.resources import card_of_device
from tests.recordkeys import OTHER_SIGNER, VERIFIER, sign_pod

CORE = "tke.cloud.tencent.com/qgpu-core"
MEM = "tke.cloud.tencent.com/qgpu-memory"
N = "n1"
CARDS = {i: CardInfo(i, f"GPU-{i}", "Tesla T4", 16384, i) for i in range(2)}


def one(name, core=30, mem=5, card=0, **kw):
    return pod(name, N, [("main", qgpu(core, mem), [(card, f"GPU-{card}", core * 10, mem * 1024)])], **kw)


def test_oldest_bind_time_wins_among_same_size_pods():
    pods = [one("c", bind_time=30), one("a", bind_time=10), one("b", bind_time=20)]
    assert match(N, CORE, 30, pods, set(), VERIFIER, cards=CARDS).pod == "a"


def test_served_containers_are_skipped_so_the_next_pod_is_chosen():
    a, b = one("a", bind_time=10), one("b", bind_time=20)
    served = {(a["metadata"]["uid"], "main", CORE)}
    assert match(N, CORE, 30, [a, b], served, VERIFIER, cards=CARDS).pod == "b"


def test_in_flight_container_beats_an_older_pod():
    a, b = one("a", bind_time=10, mem=5), one("b", bind_time=20, mem=5)
    served = {(b["metadata"]["uid"], "main", CORE)}
    m = match(N, MEM, 5, [a, b], served, VERIFIER, cards=CARDS)
    assert (m.pod, m.in_flight) == ("b", True)


def test_size_must_equal_the_containers_quantity():
    pods = [one("a", core=30, bind_time=1), one("b", core=40, bind_time=2)]
    assert match(N, CORE, 40, pods, set(), VERIFIER, cards=CARDS).pod == "b"


def test_pods_without_bind_time_come_last_then_by_name():
    pods = [one("z", bind_time=None), one("y", bind_time=5), one("x", bind_time=None)]
    order = []
    served: set = set()
    for _ in range(3):
        m = match(N, CORE, 30, pods, served, VERIFIER, cards=CARDS)
        order.append(m.pod)
        served.add((m.pod_uid, m.container, CORE))
    assert order == ["y", "x", "z"]


def test_running_deleted_and_foreign_pods_are_not_candidates():
    running = one("run", bind_time=1, phase="Running")
    deleting = one("del", bind_time=2)
    deleting["metadata"]["deletionTimestamp"] = "2026-11-23T10:00:00Z"
    elsewhere = one("far", bind_time=3, record_node="n2")
    with pytest.raises(NoMatch) as err:
        match(N, CORE, 30, [running, deleting, elsewhere], set(), VERIFIER, cards=CARDS)
    assert "default/far: qgpu.io/allocation: node='n2' but the pod is bound to 'n1'" in str(err.value)


def test_unknown_record_version_is_named():
    p = one("v", bind_time=1)
    rec = json.loads(p["metadata"]["annotations"]["qgpu.io/allocation"])
    rec["version"] = 7
    p["metadata"]["annotations"]["qgpu.io/allocation"] = json.dumps(rec)
    sign_pod(p)
    with pytest.raises(NoMatch, match="version=7: this qgpu reads versions 1"):
        match(N, CORE, 30, [p], set(), VERIFIER, cards=CARDS)


def test_preferred_devices_spread_over_the_predicted_cards_after_must_include():
    available = [f"qgpu-core-{c}-{i}" for c in range(3) for i in range(100)]
    chosen = preferred_devices(available, ["qgpu-core-0-5"], 7, [1, 2], card_of_device)
    assert chosen[0] == "qgpu-core-0-5"
    assert [card_of_device(d) for d in chosen[1:]] == [1, 1, 1, 2, 2, 2]


def test_preferred_devices_answer_when_kubelet_offers_ids_spelled_oddly():
    """``²`` passes ``isdigit`` but not ``int``: the sort raised ValueError, so GetPreferredAllocation
    failed instead of steering kubelet; such an ID names no card and is never preferred to ours."""
    odd = ["qgpu-core-0-\u00b2", "qgpu-core-\u00b9-0", "qgpu-core-0-03"]
    chosen = preferred_devices(odd + ["qgpu-core-0-1", "qgpu-core-0-2"], [], 2, [0], card_of_device)
    assert chosen == ["qgpu-core-0-1", "qgpu-core-0-2"]
    assert [card_of_device(d) for d in odd] == [None, None, None]


def test_preferred_devices_fill_from_elsewhere_when_the_card_is_short():
    chosen = preferred_devices(["qgpu-core-0-0", "qgpu-core-1-0", "qgpu-core-1-1"], [], 2, [0], card_of_device)
    assert chosen == ["qgpu-core-0-0", "qgpu-core-1-0"]


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 3), st.booleans()), min_size=1, max_size=8),
       st.randoms(use_true_random=False))
def test_admission_in_bind_order_gives_every_container_its_own_record(shapes, rnd):
    """Pods of random (often equal) sizes, one or two containers, core+memory resources each:
    when kubelet admits in bind order, every container receives exactly its own record."""
    pods = []
    for i, (size, card, two) in enumerate(shapes):
        containers = [("a", qgpu(size * 10, size), [(card, f"GPU-{card}", size * 100, size * 1024)])]
        if two:
            containers.append(("b", qgpu(size * 10, size), [(card + 4, f"GPU-{card + 4}", size * 100, size * 1024)]))
        pods.append(pod(f"p{i}", N, containers, bind_time=i + 1))
    listed = pods[:]
    rnd.shuffle(listed)  # the API returns pods in any order
    served: set = set()
    for p in pods:
        for c in p["spec"]["containers"]:
            for resource in (CORE, MEM):
                size = int(c["resources"]["limits"][resource])
                m = match(N, resource, size, listed, served, VERIFIER, cards=CARDS)
                assert (m.pod, m.container) == (p["metadata"]["name"], c["name"])
                served.add((m.pod_uid, m.container, resource))


@pytest.mark.parametrize("raw", ["５０", "9" * 5000, "1e600000"])
def test_odd_or_huge_quantities_are_no_match_not_a_crash(raw):
    """Full-width digits and digit strings past Python's int limit go to the bounded parser, which
    refuses them: the container simply asks for nothing this resource can match."""
    from qgpu_runtime.node.deviceplugin.matching import container_quantity

    container = {"name": "c", "resources": {"limits": {"tke.cloud.tencent.com/qgpu-core": raw}}}
    assert container_quantity(container, "tke.cloud.tencent.com/qgpu-core") is None


def test_a_plain_count_is_read_directly():
    from qgpu_runtime.node.deviceplugin.matching import container_quantity

    container = {"name": "c", "resources": {"limits": {"tke.cloud.tencent.com/qgpu-core": "50"}}}
    assert container_quantity(container, "tke.cloud.tencent.com/qgpu-core") == 50


@pytest.mark.parametrize("change, field", [
    (lambda r: r["containers"][0]["cards"][0].update(index="0"), r"index='0': wrong type"),
    (lambda r: r["containers"][0]["cards"][0].update(index=True), r"index=True: wrong type"),
    (lambda r: r["containers"][0]["cards"][0].update(core_milli=1500), r"core_milli=1500"),
    (lambda r: r["containers"][0]["cards"][0].update(memory_mib=-1024), r"memory_mib=-1024"),
    (lambda r: r.pop("class"), r"class is missing"),
    (lambda r: r.pop("policy"), r"policy is missing"),
])
def test_the_device_plugin_refuses_every_record_the_extender_refuses(change, field):
    """One strict codec (contract/record.py): the node used to read records with a laxer parser
    and served records the extender's cache refused, e.g. 1.5 cards of compute on one card."""
    p = one("v", bind_time=1)
    rec = json.loads(p["metadata"]["annotations"]["qgpu.io/allocation"])
    change(rec)
    p["metadata"]["annotations"]["qgpu.io/allocation"] = json.dumps(rec)
    sign_pod(p)
    with pytest.raises(RecordError):
        parse_record(p["metadata"]["annotations"]["qgpu.io/allocation"])  # the extender's verdict
    with pytest.raises(NoMatch, match=field):
        match(N, CORE, 30, [p], set(), VERIFIER, cards=CARDS)


# --- a pod's annotations are its owner's: only records the extender signed, no larger than asked --

def _tenant_takes_card_0_whole(**kw) -> dict:
    """The attack of issue 21: a pod asking for 10% of a card and 1 GiB, created with spec.nodeName
    and its own record granting card 0 whole."""
    return pod("greedy", N, [("main", qgpu(10, 1), [(0, "GPU-0", 1000, 16384)])], **kw)


def test_an_unsigned_record_grants_nothing_and_says_why():
    with pytest.raises(NoMatch) as err:
        match(N, CORE, 10, [_tenant_takes_card_0_whole(signed=False)], set(), VERIFIER, cards=CARDS)
    assert "qgpu.io/allocation-signature is missing" in str(err.value)
    assert "record not trusted, nothing granted" in str(err.value)
    assert len(err.value.untrusted) == 1


def test_a_record_signed_with_another_key_grants_nothing():
    p = sign_pod(_tenant_takes_card_0_whole(signed=False), OTHER_SIGNER)
    with pytest.raises(NoMatch, match="signed with another key"):
        match(N, CORE, 10, [p], set(), VERIFIER, cards=CARDS)


def test_a_signed_record_granting_more_than_the_pod_asks_for_grants_nothing():
    """Defence in depth: even a record the extender's key signed (a leaked key, a bug) may grant no
    more than the pod's own resources ask for."""
    with pytest.raises(NoMatch, match=r"core_milli=1000, the container asks for 100: a record may grant at most what is asked"):
        match(N, CORE, 10, [_tenant_takes_card_0_whole()], set(), VERIFIER, cards=CARDS)


def test_an_untrusted_record_does_not_hide_a_trusted_one_but_is_reported():
    honest = one("honest", core=10, mem=1, bind_time=5)
    m = match(N, CORE, 10, [_tenant_takes_card_0_whole(signed=False, bind_time=1), honest], set(), VERIFIER, cards=CARDS)
    assert m.pod == "honest" and len(m.untrusted) == 1 and "default/greedy" in m.untrusted[0]


@pytest.mark.parametrize("change, message", [
    (lambda r: r["containers"][0]["cards"].append({"index": 1, "uuid": "GPU-1", "core_milli": 100, "memory_mib": 1024}),
     r"grants 2 card\(s\), the container asks for 1"),
    (lambda r: r["containers"][0]["cards"][0].update(memory_mib=2048), r"memory_mib=2048, the container asks for 1024"),
    (lambda r: r["containers"].append({"name": "sidecar", "cards": [{"index": 1, "uuid": "GPU-1", "core_milli": 100,
                                                                      "memory_mib": 1024}]}), r"container 'sidecar'.*asks for no GPU"),
    (lambda r: r.update({"class": "online"}), r"class='online' but the pod asks for class 'normal'"),
])
def test_a_record_inconsistent_with_the_pod_s_requests_grants_nothing(change, message):
    p = one("v", core=10, mem=1, bind_time=1)
    rec = json.loads(p["metadata"]["annotations"]["qgpu.io/allocation"])
    change(rec)
    p["metadata"]["annotations"]["qgpu.io/allocation"] = json.dumps(rec)
    sign_pod(p)
    with pytest.raises(NoMatch, match=message):
        match(N, CORE, 10, [p], set(), VERIFIER, cards=CARDS)


def test_without_a_verifier_pods_file_records_are_read_unsigned():
    """--pods-file: the host's operator writes the file, no tenant; the shape check still holds."""
    assert match(N, CORE, 30, [one("a", signed=False)], set(), None, cards=CARDS).pod == "a"
    with pytest.raises(NoMatch, match="a record may grant at most what is asked"):
        match(N, CORE, 10, [_tenant_takes_card_0_whole(signed=False)], set(), None, cards=CARDS)


# --- a share asked as a percent of a card's memory: at most that percent of the card's own memory -

CARD_MIB = CARDS[0].memory_mib  # 16384: the node's inventory, never the record, sizes the card


def _percent_pod(dialect: str, memory_mib: int, card: tuple[int, str] = (0, "GPU-0")) -> dict:
    """A pod asking for a percent of one card's memory, its signed record granting ``memory_mib``
    on ``card``: KAI gpu-fraction 0.01 (1 %), T9k nvidia-gpu-percent 33, HAMi gpumem-percentage 7."""
    limits, core, notes, spec = {
        "kai": ({"nvidia.com/gpu": "1"}, 0, {"gpu-fraction": "0.01"}, {"schedulerName": "kai-scheduler"}),
        "t9k": ({"tensorstack.dev/nvidia-gpu-percent": "33"}, 0, {}, {}),
        "hami": ({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "7", "nvidia.com/gpucores": "30"}, 300, {}, {}),
    }[dialect]
    p = pod(f"pct-{dialect}", N, [("main", limits, [(card[0], card[1], core, memory_mib)])], signed=False)
    p["metadata"]["annotations"].update(notes)
    p["spec"].update(spec)
    return sign_pod(p)


PERCENT_SHARES = [("kai", 1, 164), ("t9k", 33, 5407), ("hami", 7, 1147)]  # ceil(16384 * pct / 100)


@pytest.mark.parametrize("dialect, pct, allowed", PERCENT_SHARES)
def test_a_percent_share_whose_record_grants_more_of_the_card_than_the_percent_grants_nothing(dialect, pct, allowed):
    """Security audit, finding F2: the memory of a percent-of-memory share was never checked, so a
    signed record granting a KAI 1 % share the card's whole memory (or 1 TiB) passed the node."""
    for granted in (CARD_MIB, allowed + 1, 1 << 20):
        e = examine(_percent_pod(dialect, granted), N, VERIFIER, cards=CARDS)
        assert e is not None and e.record is None and e.untrusted, (dialect, granted, e)
        assert (f"container 'main': card 0 (GPU-0): memory_mib={granted}, the container asks for {pct}% of the "
                f"card's {CARD_MIB} MiB = {allowed} MiB: a record may grant at most what is asked") in e.untrusted


@pytest.mark.parametrize("dialect, pct, allowed", PERCENT_SHARES)
def test_a_percent_share_whose_record_grants_the_rounded_percent_of_the_card_is_accepted(dialect, pct, allowed):
    """The bound is the placement engine's own rounding (model.requests.percent_share_memory_mib)."""
    assert percent_share_memory_mib(CARD_MIB, pct) == allowed
    for granted in (allowed, allowed - 1):
        e = examine(_percent_pod(dialect, granted), N, VERIFIER, cards=CARDS)
        assert e is not None and e.untrusted is None and e.record is not None, (dialect, granted, e)
        assert e.record.containers[0].shares[0].memory_mib == granted


@pytest.mark.parametrize("dialect", ["kai", "t9k", "hami"])
@pytest.mark.parametrize("card, have", [((7, "GPU-7"), "this node has no card 7"), ((1, "GPU-0"), "card 1 is GPU-1")])
def test_a_percent_share_on_a_card_this_node_does_not_have_grants_nothing(dialect, card, have):
    """Fail closed: the card's size comes from the node's inventory only; a card it does not know
    (no such index, or another card's UUID there) cannot bound the share."""
    e = examine(_percent_pod(dialect, 1, card), N, VERIFIER, cards=CARDS)
    assert e is not None and e.record is None and e.untrusted, e
    assert (f"container 'main': card {card[0]} ({card[1]}): {have}, so the") in e.untrusted
    assert "cannot be bounded: a record may grant only this node's cards" in e.untrusted


def test_a_percent_share_is_refused_by_the_allocate_match_too():
    with pytest.raises(NoMatch, match=r"asks for 33% of the card's 16384 MiB = 5407 MiB"):
        match(N, "tensorstack.dev/nvidia-gpu-percent", 33, [_percent_pod("t9k", CARD_MIB)], set(), VERIFIER, cards=CARDS)


def stranger(name, limits, *, init=False, phase="Pending"):
    """A pod bound to the node at creation (spec.nodeName) with GPU resources and no record."""
    container = {"name": "main", "resources": {"limits": dict(limits)}}
    spec = {"nodeName": N, "containers": [{"name": "side"}] if init else [container]}
    if init:
        spec["initContainers"] = [container]
    return {"metadata": {"name": name, "namespace": "tenant", "uid": f"uid-{name}", "annotations": {}},
            "spec": spec, "status": {"phase": phase}}


def test_a_call_that_may_be_for_a_pod_with_no_record_is_refused_not_granted_to_the_recorded_one():
    """A tenant's pod created with spec.nodeName and qgpu-core 30 (no record): kubelet admitting it
    calls Allocate for 30, and the pending pod of that size with a record was matched, its cards
    granted to the stranger (helper audit, 2026-12-01). Now the call is refused, naming both."""
    victim = one("victim", bind_time=10)
    for intruder in (stranger("intruder", {CORE: "30", MEM: "5"}), stranger("intruder", {CORE: "30"}, init=True)):
        with pytest.raises(NoMatch) as err:
            match(N, CORE, 30, [victim, intruder], set(), VERIFIER, cards=CARDS)
        message = str(err.value)
        assert "may be for tenant/intruder" in message and "no qgpu.io/allocation record" in message, message
        assert "cards recorded for default/victim" in message, message


def test_a_pod_with_no_record_of_another_size_or_finished_leaves_the_match_alone():
    victim = one("victim", bind_time=10)
    for other in (stranger("other", {CORE: "40"}), stranger("done", {CORE: "30"}, phase="Failed"),
                  stranger("cpu", {"cpu": "1"}), stranger("vcuda", {"tencent.com/vcuda-core": "30"})):
        assert match(N, CORE, 30, [victim, other], set(), VERIFIER, cards=CARDS).pod == "victim"
    # the stranger's container already counted as served for this resource (never by qgpu, but
    # the rule reads only what is left): not a reason to refuse
    intruder = stranger("intruder", {CORE: "30"})
    assert match(N, CORE, 30, [victim, intruder], {("uid-intruder", "main", CORE)}, VERIFIER, cards=CARDS).pod == "victim"


def test_a_container_in_flight_keeps_its_second_resource_beside_a_stranger():
    """qgpu-memory after qgpu-core of the same container: kubelet is admitting that pod now."""
    victim = one("victim", bind_time=10, mem=5)
    intruder = stranger("intruder", {CORE: "30", MEM: "5"})
    m = match(N, MEM, 5, [victim, intruder], {(victim["metadata"]["uid"], "main", CORE)}, VERIFIER, cards=CARDS)
    assert (m.pod, m.in_flight) == ("victim", True)


def test_with_no_recorded_candidate_the_stranger_is_named_in_the_refusal():
    with pytest.raises(NoMatch, match="tenant/intruder asks for it with no allocation record"):
        match(N, CORE, 30, [stranger("intruder", {CORE: "30"})], set(), VERIFIER, cards=CARDS)


# -- a pod past the entries qgpu keeps of one (kube/podslim.py) -----------------------------------

def _wide(p: dict, n: int = 600) -> dict:
    """``p`` with ``n`` more containers asking no GPU: past MAX_KEPT_POD_ENTRIES, kept oversized."""
    p["spec"]["containers"] = [*p["spec"]["containers"], *({"name": f"w{i}", "image": "busybox"} for i in range(n))]
    return p


def test_a_pod_past_the_entries_budget_is_matched_to_no_call_and_its_record_is_refused_by_name():
    """Kept without its containers, its record cannot be checked against them nor a container
    chosen: nothing is granted, and the refusal names the pod, the list, its length and the bound.
    (The extender places no such pod: a record on one is an older release's.)"""
    from qgpu_runtime.kube.podslim import MAX_KEPT_POD_ENTRIES, kept

    big = _wide(one("big", bind_time=10))
    for form in (big, kept(big)):
        with pytest.raises(NoMatch) as err:
            match(N, CORE, 30, [form], set(), VERIFIER, cards=CARDS)
        assert "default/big: it lists 601 spec.containers (" in str(err.value)
        assert f"past the {MAX_KEPT_POD_ENTRIES} entries" in str(err.value) and "nothing is granted" in str(err.value)
    assert match(N, CORE, 30, [kept(big), one("small", bind_time=20)], set(), VERIFIER, cards=CARDS).pod == "small"


def test_a_pod_past_the_budget_listing_a_gpu_resource_without_a_record_is_a_stranger_to_every_call_of_it():
    """Rule 5 with the containers' sizes not kept: a pod that lists qgpu-core with no record may be
    the subject of any qgpu-core call, so one is refused rather than grant the recorded pod's cards
    to it; one that lists no GPU resource, or another one, changes nothing."""
    from qgpu_runtime.kube.podslim import kept

    victim = one("victim", bind_time=10)
    intruder = kept(_wide(stranger("intruder", {CORE: "70"})))  # another size: only the resource is known
    with pytest.raises(NoMatch) as err:
        match(N, CORE, 30, [victim, intruder], set(), VERIFIER, cards=CARDS)
    assert "may be for tenant/intruder" in str(err.value) and "cards recorded for default/victim" in str(err.value)
    for other in (stranger("cpu", {"cpu": "1"}), stranger("vcuda", {"tencent.com/vcuda-core": "30"})):
        assert match(N, CORE, 30, [victim, kept(_wide(other))], set(), VERIFIER, cards=CARDS).pod == "victim"
