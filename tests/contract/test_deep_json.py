"""JSON nested past the decoder's recursion limit ('[[[[…'), in every document qgpu decodes from
someone else: each reader refuses it with its own error class, as any other malformed value, and
never lets a RecursionError out. A pod's annotations are its owner's to write (a tenant with
`edit`), so before this a bound pod carrying ``qgpu.io/allocation: "[[[[…"`` and any signature made
the extender's cache raise on the pod's watch event and on every relist."""

from __future__ import annotations

import pytest

from qgpu_runtime.contract.inventory import NodeInventoryError, parse_inventory
from qgpu_runtime.contract.leases import BindersError, CommitmentError, LedgerError, parse_binders, parse_commitments, parse_ledger
from qgpu_runtime.contract.record import RecordError, assigned, parse_record
from qgpu_runtime.contract.signature import trusted_record
from qgpu_runtime.extender.wire import BindingArgs, ExtenderArgs, WireError
from qgpu_runtime.jsondoc import load_json
from qgpu_runtime.model.requests import parse_pod
from qgpu_runtime.webhook.admission import ReviewError, WebhookConfig, mutate, validate
from tests.extender.test_kube_cache import SEC, cache, pod
from tests.recordkeys import VERIFIER

DEEP = "[" * 5000 + "]" * 5000
DEEP_OBJECT = '{"a":' * 5000 + "1" + "}" * 5000


@pytest.mark.parametrize("raw", [DEEP, DEEP_OBJECT, DEEP.encode()])
def test_load_json_refuses_deep_nesting_with_the_callers_error(raw):
    with pytest.raises(KeyError, match="thing is not JSON qgpu decodes: arrays and objects nested deeper than the decoder's"):
        load_json(raw, dict, "thing", KeyError)


@pytest.mark.parametrize(("read", "error"), [
    (lambda raw: parse_record(raw), RecordError),
    (lambda raw: parse_inventory("n1", raw), NodeInventoryError),
    (lambda raw: parse_commitments(raw, "n1"), CommitmentError),
    (lambda raw: parse_binders(raw), BindersError),
    (lambda raw: parse_ledger(raw), LedgerError),
    (lambda raw: ExtenderArgs.decode(raw.encode()), WireError),
    (lambda raw: BindingArgs.decode(raw.encode()), WireError),
], ids=["record", "inventory", "commitments", "binders", "ledger", "extender-args", "binding-args"])
def test_every_reader_refuses_deep_nesting_with_its_own_error(read, error):
    for raw in (DEEP, DEEP_OBJECT):
        with pytest.raises(error):
            read(raw)


def test_a_deep_record_with_a_signature_is_a_record_error_before_the_signature_is_checked():
    p = pod("evil", annotations={"qgpu.io/allocation": DEEP, "qgpu.io/allocation-signature": "x"})
    with pytest.raises(RecordError, match="nested deeper"):
        trusted_record(p, VERIFIER)


def test_a_deep_assigned_annotation_reads_as_none_served():
    assert assigned(pod("evil", annotations={"qgpu.io/assigned": DEEP})) == []


def test_a_bound_pod_with_a_deep_record_books_nothing_and_the_cache_goes_on():
    c = cache()
    evil = pod("evil", annotations={"qgpu.io/allocation": DEEP, "qgpu.io/allocation-signature": "x"})
    evil["spec"]["nodeName"] = "a"
    c.replace_pods([evil])  # the relist
    c.apply_pod("MODIFIED", evil)  # the watch event
    assert c.booking("ns/evil") is None
    assert any("ns/evil" in p and "nested deeper" in p for p in c.problems), c.problems
    small = pod("small", core=10, memory=1)
    assert "a" in c.filter(small, parse_pod(small), ["a"], 1_000 * SEC).passed


@pytest.mark.parametrize("answer", [validate, mutate])
def test_a_deep_admission_review_is_refused_as_malformed(answer):
    with pytest.raises(ReviewError, match="AdmissionReview: body is not JSON qgpu decodes"):
        answer(DEEP_OBJECT.encode(), WebhookConfig())
