"""The extender's cache books only records it signed (issue 21): a pod's annotations are its
owner's, so self-written records, copied records and far-future bind-times book nothing."""

from __future__ import annotations

import copy
import json

from qgpu_runtime.model.requests import parse_pod
from tests.extender.test_kube_cache import SEC, bind_locally, cache, pod
from tests.recordkeys import OTHER_SIGNER, sign_pod, signed

NOW = 1_000 * SEC


def _takes_every_card(name: str, node: str = "a") -> dict:
    """An unscheduled pod (schedulerName: nobody) carrying its own record for every card of ``node``
    and a bind-time of 9e18: before, the cache booked it past --assume-timeout, for ever."""
    record = {"version": 1, "node": node, "policy": "binpack", "class": "normal", "time": "t",
              "containers": [{"name": "c", "cards": [{"index": i, "uuid": f"GPU-{node}-{i}", "core_milli": 1000,
                                                      "memory_mib": 32768} for i in range(2)]}]}
    return pod(name, annotations={"qgpu.io/allocation": json.dumps(record), "qgpu.io/bind-time": str(9 * 10**18)})


def test_self_written_records_book_nothing_and_another_pod_still_fits():
    c = cache()
    c.replace_pods([_takes_every_card("x"), _takes_every_card("y")])
    assert c.booking("ns/x") is None and c.booking("ns/y") is None
    assert set(c.untrusted()) == {"ns/x", "ns/y"}
    assert "qgpu.io/allocation-signature is missing" in c.untrusted()["ns/x"]
    assert any("ns/x: allocation record not trusted, booked nowhere" in p for p in c.problems)
    small = pod("small", core=10, memory=1)
    assert c.filter(small, parse_pod(small), ["a"], NOW).passed == ["a"]
    assert c.expire(NOW) == []  # nothing booked, nothing for the extender to delete on a tenant's pod


def test_the_untrusted_records_of_live_pods_are_a_metric():
    from qgpu_runtime.extender.app import ExtenderApp
    from qgpu_runtime.model.requests import DEFAULT_LIMITS

    c = cache()
    app = ExtenderApp(c, None, DEFAULT_LIMITS)
    c.replace_pods([_takes_every_card("x"), _takes_every_card("y")])
    app.refresh_gauges()
    assert app.metrics.registry.get_sample_value("qgpu_extender_untrusted_records") == 2
    c.apply_pod("DELETED", _takes_every_card("x"))
    c.apply_pod("MODIFIED", {**_takes_every_card("y"), "status": {"phase": "Failed"}})
    app.refresh_gauges()
    assert app.metrics.registry.get_sample_value("qgpu_extender_untrusted_records") == 0


def test_a_record_signed_with_another_key_books_nothing():
    c = cache()
    c.apply_pod("ADDED", sign_pod(_takes_every_card("x"), OTHER_SIGNER))
    assert c.booking("ns/x") is None and "signed with another key" in c.untrusted()["ns/x"]


def test_a_record_copied_from_a_bound_pod_onto_another_books_nothing():
    c = cache()
    original = bind_locally(c, pod("p"), "a", NOW)
    c.apply_pod("MODIFIED", original)
    copied = copy.deepcopy(original)
    copied["metadata"].update(name="copy", uid="uid-copy")
    c.apply_pod("ADDED", copied)
    assert c.booking("ns/p") is not None and c.booking("ns/copy") is None
    assert "uid-copy" in c.untrusted()["ns/copy"]


def test_a_record_that_loses_its_signature_stops_booking():
    c = cache()
    p = bind_locally(c, pod("p"), "a", NOW)
    c.apply_pod("MODIFIED", p)
    stripped = copy.deepcopy(p)
    del stripped["metadata"]["annotations"]["qgpu.io/allocation-signature"]
    c.apply_pod("MODIFIED", stripped)
    assert c.booking("ns/p") is None


def _assumed(c, name: str, bind_time_ns: int) -> dict:
    """A signed record on a pod not bound yet (a bind in flight), as another replica wrote it."""
    other = cache()
    p = pod(name)
    record = other.reserve(p, parse_pod(p), "a", bind_time_ns)
    return {**p, "metadata": {**p["metadata"], "annotations": signed(record, bind_time_ns, p["metadata"]["uid"])}}


def test_a_signed_assumed_record_books_until_its_bind_time_plus_the_timeout():
    c = cache(ttl_s=60)
    c.apply_pod("ADDED", _assumed(c, "p", NOW))
    assert c.booking("ns/p") is not None
    assert c.expire(NOW + 59 * SEC) == [] and c.booking("ns/p") is not None
    assert [e.name for e in c.expire(NOW + 60 * SEC)] == ["p"] and c.booking("ns/p") is None


def test_a_bind_time_beyond_now_plus_the_timeout_is_expired_at_once():
    """Even signed: a replica whose clock runs far ahead cannot keep an assumed record alive."""
    c = cache(ttl_s=60)
    c.apply_pod("ADDED", _assumed(c, "ahead", NOW + 61 * SEC))
    c.apply_pod("ADDED", _assumed(c, "skewed", NOW + 30 * SEC))
    assert c.booking("ns/ahead") is not None
    assert [e.name for e in c.expire(NOW)] == ["ahead"]
    assert c.booking("ns/ahead") is None and c.booking("ns/skewed") is not None
