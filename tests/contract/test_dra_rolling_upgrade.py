"""Version skew of the DRA formats during a rolling upgrade, both directions.

Old writer, new reader: the ResourceSlice, claim templates and allocated claim that the release
before issue 24 wrote (previous_release/dra_written.json) are read by today's decoders
(contract/dra.py ``read_slice``, contract/draclaim.py) with the same meaning its own readers gave
them. New writer, old reader: what today's node manager and webhook write is read by that release's
frozen readers (previous_release/dra_readers.py) with the same meaning as by today's. Both also
after kube-apiserver's canonical rewriting of quantities (``1000`` is served back ``1k``).
"""

from __future__ import annotations

import copy
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from qgpu_runtime.contract import dra, draclaim
from qgpu_runtime.extender.dra import claim_asks, claim_usage, slice_cards
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.node.dra.slices import resource_slice, slice_devices
from qgpu_runtime.webhook.claimquota import claim_usage as quota_usage
from qgpu_runtime.webhook.dra import DraConfig, convert
from tests.contract.previous_release import dra_readers as old

WRITTEN = json.loads((Path(__file__).parent / "previous_release" / "dra_written.json").read_text())
CARD_MIB = 32768
CARDS = {0: CardInfo(0, "GPU-aaaa", "Tesla V100-SXM2-32GB", 32510, 0), 1: CardInfo(1, "GPU-bbbb", "Tesla V100-SXM2-32GB", 32510, 1),
         2: CardInfo(2, "GPU-cccc", "Tesla T4", 15109, 2)}


def _pod(limits: dict[str, str], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": "team-a"}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": limits}}]}}


# The pods whose templates previous_release/dra_written.json holds, by key.
PODS = {
    "qgpu-share": _pod({"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "4"}),
    "qgpu-offline": _pod({"tke.cloud.tencent.com/qgpu-core-greedy": "25", "tke.cloud.tencent.com/qgpu-memory": "3"},
                         {"tke.cloud.tencent.com/app-class": "offline"}),
    "t9k-whole-x2": _pod({"tensorstack.dev/nvidia-gpu": "2"}, {"qgpu.io/gpu-model": "Tesla T4"}),
    "t9k-node": _pod({"tensorstack.dev/nvidia-gpu-node": "1"}),
    "t9k-percent": _pod({"tensorstack.dev/nvidia-gpu-percent": "25"}),
}
CONFIG = DraConfig(card_memory_mib=(15360, 32768))


def _written_templates() -> dict[str, dict[str, Any]]:
    """Today's webhook's templates for the recorded pods."""
    out = {}
    for key, pod in PODS.items():
        (template,) = convert(pod, CONFIG).templates
        out[key] = template.manifest("team-a")
    return out


def _written_slice() -> dict[str, Any]:
    return resource_slice("gpu-node-1", "node-uid-1", slice_devices(CARDS, {2: "XID 79: fell off the bus"}, Policy("fixed-share")), 3)


def _canonical(text: str) -> str:
    """kube-apiserver's canonical form of a whole decimal quantity: trailing zeros as k, M, G, ..."""
    number, suffix = Decimal(text), ""
    for s in ("k", "M", "G", "T", "P", "E"):
        if number == 0 or number % 1000:
            break
        number, suffix = number / 1000, s
    return f"{int(number)}{suffix}"


def _served(doc: Any) -> Any:
    """``doc`` as kube-apiserver serves it back: every capacity quantity in canonical form."""
    doc = copy.deepcopy(doc)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("value", "default", "min", "max", "step", dra.CORE, dra.MEMORY, dra.PODS) and isinstance(value, str) \
                        and value.isdigit():
                    node[key] = _canonical(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(doc)
    return doc


def _claim_of(template: dict[str, Any], name: str = "c") -> dict[str, Any]:
    return {"metadata": {"namespace": "team-a", "name": name}, "spec": template["spec"]["spec"]}


def _asks(reader: Any, spec: dict[str, Any]) -> list[tuple[int | None, int | None]] | str:
    """What the extender of either release scores a claim spec with; a DemandError (both releases'
    are ValueErrors) is no preference."""
    try:
        return [(a.core, a.memory) for a in reader(spec)]
    except ValueError:
        return "no preference"


def _usage(reader: Any, claim: dict[str, Any]) -> tuple[int, int]:
    u = reader(claim, CARD_MIB)
    return u.core_milli, u.memory_mib


def _shares(shares: list[Any]) -> list[tuple[Any, ...]]:
    return [(s.request, s.pool, s.device, s.card_index, s.core_milli, s.memory_mib, s.share_id) for s in shares]


# --- the writers did not change -------------------------------------------------------------------

def test_this_node_manager_writes_the_slice_the_previous_one_wrote():
    assert _written_slice() == WRITTEN["resource_slice"]


def test_this_webhook_writes_the_claim_templates_the_previous_one_wrote():
    written = _written_templates()
    # One change on purpose (issue 22 §2): a whole-node claim tells the node its T9k mode in the
    # ShareConfig, under a new name; the previous node's ShareConfig reader (appClass and greedy
    # only, other keys ignored) reads it as the normal share it wrote before.
    node = written.pop("t9k-node")
    percent = written.pop("t9k-percent")
    previous = dict(WRITTEN["claim_templates"])
    before = previous.pop("t9k-node")
    percent_before = previous.pop("t9k-percent")
    assert written == previous
    assert node["metadata"]["name"] == "qgpu-node-t9k" and node["spec"]["spec"]["devices"]["requests"] == \
        before["spec"]["spec"]["devices"]["requests"]
    (config,) = node["spec"]["spec"]["devices"]["config"]
    parameters = config["opaque"]["parameters"]
    assert (parameters["appClass"], parameters["greedy"], parameters["dialect"]) == ("normal", False, {"dialect": "t9k", "whole_node": True})
    # And a T9k percent claim (memory only) tells the node to book core 0, as device-plugin pools
    # do, under a new name: the same requests, and a ShareConfig the previous node reads as normal.
    assert percent["metadata"]["name"] == percent_before["metadata"]["name"] + "-mo"
    assert percent["spec"]["spec"]["devices"]["requests"] == percent_before["spec"]["spec"]["devices"]["requests"]
    (config,) = percent["spec"]["spec"]["devices"]["config"]
    parameters = config["opaque"]["parameters"]
    assert (parameters["appClass"], parameters["greedy"], parameters["memoryOnly"]) == ("normal", False, True)


# --- old writer, new reader -----------------------------------------------------------------------

@pytest.mark.parametrize("served", [False, True], ids=["as-written", "as-served"])
def test_a_slice_the_previous_node_manager_wrote_is_read_alike_by_this_extender(served):
    doc = _served(WRITTEN["resource_slice"]) if served else WRITTEN["resource_slice"]
    assert slice_cards(doc) == old.slice_cards(doc)
    read = dra.read_slice(doc)
    assert read is not None and read.dropped == ()
    assert [(c.device, c.index, c.memory_mib, c.policy) for c in read.cards] == \
        [("gpu-0", 0, 31744, "fixed-share"), ("gpu-1", 1, 31744, "fixed-share"), ("gpu-2", 2, 14336, "fixed-share")]


@pytest.mark.parametrize("served", [False, True], ids=["as-written", "as-served"])
@pytest.mark.parametrize("key", sorted(PODS))
def test_templates_the_previous_webhook_wrote_ask_the_same_of_every_reader_here(key, served):
    template = WRITTEN["claim_templates"][key]
    spec = (_served(template) if served else template)["spec"]["spec"]
    claim = {"metadata": {"namespace": "team-a", "name": "c"}, "spec": spec}
    assert _asks(claim_asks, spec) == _asks(old.claim_asks, spec)
    assert _usage(quota_usage, claim) == _usage(old.quota_usage, claim)


@pytest.mark.parametrize("served", [False, True], ids=["as-written", "as-served"])
def test_an_allocated_claim_of_the_previous_release_is_read_alike_by_the_node_and_the_extender(served):
    claim = _served(WRITTEN["allocated_claim"]) if served else WRITTEN["allocated_claim"]
    assert _shares(draclaim.claim_shares(claim, "gpu-node-1")) == _shares(old.claim_shares(claim, "gpu-node-1"))
    assert [(u.node, u.device, u.core, u.memory) for u in claim_usage(claim)] == \
        [(u.node, u.device, u.core, u.memory) for u in old.claim_usage(claim)] == [("gpu-node-1", "gpu-1", 250, 3072)]
    assert draclaim.claim_share_settings(claim, ["gpu"]) == {"gpu": draclaim.ShareSettings("offline", True)}


# --- new writer, old reader -----------------------------------------------------------------------

@pytest.mark.parametrize("served", [False, True], ids=["as-written", "as-served"])
@pytest.mark.parametrize("memory_mib", [15109, 32510, 81920, 131072])
def test_the_previous_extender_reads_every_slice_this_node_manager_writes(memory_mib, served):
    cards = {i: CardInfo(i, f"GPU-{i}", "H100", memory_mib, i) for i in range(4)}
    doc = resource_slice("n", "uid", slice_devices(cards, {}, Policy("burst-share")), 1)
    doc = _served(doc) if served else doc
    new = slice_cards(doc)
    assert new is not None and [c.index for _, c in new[1]] == [0, 1, 2, 3]
    assert old.slice_cards(doc) == new


def test_a_slice_memory_the_apiserver_serves_with_a_suffix_is_a_card_now():
    """A 125 GiB card's memory, 128000 MiB, is served back "128k": the previous extender dropped the
    card (it read plain digits only); this one reads it, as it reads claims."""
    doc = resource_slice("n", "uid", slice_devices({0: CardInfo(0, "GPU-0", "X", 128000, 0)}, {}, Policy("best-effort")), 1)
    served = _served(doc)
    assert served["spec"]["devices"][0]["capacity"]["memory"]["value"] == "128k"
    assert old.slice_cards(served) == ("n", [])
    assert [c.memory_mib for _, c in slice_cards(served)[1]] == [128000]


@pytest.mark.parametrize("served", [False, True], ids=["as-written", "as-served"])
@pytest.mark.parametrize("key", sorted(PODS))
def test_the_previous_readers_read_the_templates_this_webhook_writes_alike(key, served):
    template = _written_templates()[key]
    spec = (_served(template) if served else template)["spec"]["spec"]
    claim = {"metadata": {"namespace": "team-a", "name": "c"}, "spec": spec}
    assert _usage(old.quota_usage, claim) == _usage(quota_usage, claim)
    assert _asks(old.claim_asks, spec) == _asks(claim_asks, spec)
    assert (_asks(claim_asks, spec) == "no preference") == (key == "t9k-node")  # allocationMode All is not scored


@pytest.mark.parametrize("core,memory", [("10", "1024"), ("250", "3072"), ("1000", "32768"), ("1k", "128k")])
def test_the_previous_node_reads_an_allocation_of_a_claim_this_webhook_wrote_alike(core, memory):
    claim = _claim_of(_written_templates()["qgpu-share"])
    claim["status"] = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": dra.DRIVER, "pool": "n", "device": "gpu-3", "shareID": "s",
         "consumedCapacity": {"core": core, "memory": memory, "pods": "1"}}]}}}
    assert _shares(old.claim_shares(claim, "n")) == _shares(draclaim.claim_shares(claim, "n"))
