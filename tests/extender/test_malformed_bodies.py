"""Any wrong-typed field anywhere in an extender body is a 400 naming it: never an exception
(which the HTTP layer would turn into a 500)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings

from qgpu_runtime.extender.app import ExtenderApp
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.placement.policies import make_policy
from tests.extender.test_kube_cache import node
from tests.jsonmutation import mutations
from tests.recordkeys import VERIFIER

POD = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"app": "x"},
                 "annotations": {"tke.cloud.tencent.com/app-class": "online", "qgpu.io/gpu-model": "V100|T4"}},
    "spec": {
        "containers": [{"name": "c", "resources": {"limits": {"tke.cloud.tencent.com/qgpu-memory": "4", "cpu": "1"},
                                                   "requests": {"tke.cloud.tencent.com/qgpu-memory": "4", "memory": "1Gi"}}}],
        "initContainers": [{"name": "i", "resources": {"limits": {"cpu": "1"}}}],
        "tolerations": [{"key": "k", "operator": "Exists"}],
        "schedulerName": "qgpu-scheduler",
    },
    "status": {"phase": "Pending"},
}
BY_NAMES = {"Pod": POD, "NodeNames": ["a", "b"]}
BY_NODES = {"Pod": POD, "Nodes": {"items": [{"metadata": {"name": "a"}}, {"metadata": {"name": "b"}}]}}


@pytest.fixture(scope="module")
def app() -> ExtenderApp:
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([node("a"), node("b", n_cards=1)])
    cache.replace_pods([])
    return ExtenderApp(cache, None, DEFAULT_LIMITS)


def answer(app: ExtenderApp, verb: str, doc: object) -> tuple[int, object]:
    status, body = app.handle(verb, json.dumps(doc).encode())
    if status != 200:
        assert status == 400 and body["Error"], body
    return status, body


@pytest.mark.parametrize("verb", ["filter", "prioritize"])
@pytest.mark.parametrize("change,field", [
    ({"containers": 5}, "ExtenderArgs.Pod.spec.containers=5"),
    ({"containers": [{"name": "c", "resources": []}]}, "ExtenderArgs.Pod.spec.containers[0].resources=[]"),
    ({"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 5}}}]},
     "ExtenderArgs.Pod.spec.containers[0].resources.limits['nvidia.com/gpu']=5"),
    ({"containers": [None]}, "ExtenderArgs.Pod.spec.containers[0]=None"),
    ({"tolerations": "all"}, "ExtenderArgs.Pod.spec.tolerations=all"),
])
def test_wrong_typed_pod_fields_are_400_naming_the_field(app, verb, change, field):
    doc = {"Pod": {**POD, "spec": {**POD["spec"], **change}}, "NodeNames": ["a"]}
    status, body = app.handle(verb, json.dumps(doc).encode())
    assert status == 400 and body["Error"].startswith(field), body


def test_wrong_typed_annotations_are_400(app):
    doc = {"Pod": {**POD, "metadata": {"name": "p", "annotations": {"qgpu.io/gpu-model": ["V100"]}}}, "NodeNames": ["a"]}
    status, body = app.handle("filter", json.dumps(doc).encode())
    assert status == 400 and body["Error"].startswith("ExtenderArgs.Pod.metadata.annotations['qgpu.io/gpu-model']=['V100']")


def test_a_node_name_that_is_not_a_string_is_400(app):
    doc = {"Pod": POD, "Nodes": {"items": [{"metadata": {"name": ["a"]}}]}}
    status, body = app.handle("filter", json.dumps(doc).encode())
    assert status == 400 and body["Error"].startswith("ExtenderArgs.Nodes.items[0].metadata.name=['a']")


@settings(max_examples=400, deadline=None)
@given(doc=mutations(BY_NAMES) | mutations(BY_NODES))
def test_structure_mutated_filter_bodies_are_answered(app, doc):
    answer(app, "filter", doc)


@settings(max_examples=300, deadline=None)
@given(doc=mutations(BY_NAMES) | mutations(BY_NODES))
def test_structure_mutated_prioritize_bodies_are_answered(app, doc):
    answer(app, "prioritize", doc)


@settings(max_examples=100, deadline=None)
@given(doc=mutations({"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "a"}))
def test_structure_mutated_bind_bodies_are_answered(app, doc):
    answer(app, "bind", doc)


BY_META_VICTIMS = {"Pod": POD, "NodeNameToMetaVictims": {"a": {"Pods": [{"UID": "v-1"}], "NumPDBViolations": 0}}}
BY_FULL_VICTIMS = {"Pod": POD, "NodeNameToVictims": {"a": {"Pods": [{"metadata": {"uid": "v-1"}}], "NumPDBViolations": 1}}}


@settings(max_examples=200, deadline=None)
@given(doc=mutations(BY_META_VICTIMS) | mutations(BY_FULL_VICTIMS))
def test_structure_mutated_preempt_bodies_are_answered(app, doc):
    answer(app, "preempt", doc)
