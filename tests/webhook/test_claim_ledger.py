"""The claim-quota reservation ledger (webhook/ledger.py) and reservations counting as used."""

from __future__ import annotations

import pytest

from qgpu_runtime.contract.dra import SHARED_CLASS
from qgpu_runtime.contract.leases import LedgerError, Reservation, encode_ledger, parse_ledger
from qgpu_runtime.webhook.claimquota import CORE_QUOTA, MEMORY_QUOTA, Usage, claim_admission
from qgpu_runtime.webhook.ledger import pending, reserved_usage, stamps


def test_the_ledger_round_trips():
    entries = {"a": Reservation(300, 4096, 100.5), "b": Reservation(1000, 0, 101.0)}
    assert parse_ledger(encode_ledger(entries)) == entries


def test_an_absent_ledger_has_no_reservations():
    assert parse_ledger(None) == {}


@pytest.mark.parametrize("raw, words", [
    ("{", "is not JSON"),
    ('{"version": 2, "reservations": {}}', "must be an object with version 1"),
    ('{"version": 1, "reservations": {"a": 3}}', "reservations['a']=3: must be an object"),
    ('{"version": 1, "reservations": {"a": {"core": -1, "memory": 0, "expires": 1}}}', "reservations['a'].core=-1"),
    ('{"version": 1, "reservations": {"a": {"core": 1, "memory": true, "expires": 1}}}', "reservations['a'].memory=True"),
    ('{"version": 1, "reservations": {"a": {"core": 1, "memory": 1, "expires": "soon"}}}', "expires='soon': must be a finite number"),
])
def test_an_unreadable_ledger_is_an_error_naming_the_field(raw, words):
    with pytest.raises(LedgerError, match=None) as e:
        parse_ledger(raw)
    assert words in str(e.value)


def test_a_reservation_counts_until_this_replica_watched_it_for_the_ttl_or_its_claim_is_visible():
    entries = {"early": Reservation(100, 1, 50.0), "stored": Reservation(200, 2, 150.0), "new": Reservation(400, 4, 150.0),
               "unseen": Reservation(800, 8, 0.0)}
    ages = {"early": 30.0, "stored": 1.0, "new": 29.9}
    # "unseen" has no age here: just seen, it counts, whatever its writer's stamp says
    assert pending(entries, ages, 30.0, {"stored"}) == {"new": Reservation(400, 4, 150.0), "unseen": Reservation(800, 8, 0.0)}
    assert reserved_usage(entries) == Usage(1500, 15)


def test_the_writers_stamp_does_not_decide_expiry():
    """A stamp far in the past (a writer whose clock runs behind) or far in the future (one ahead)
    neither ends nor extends an entry: only the reader's own watching does (contract/observed.py)."""
    entries = {"past": Reservation(1, 1, -1e12), "future": Reservation(1, 1, 1e12)}
    assert set(pending(entries, {"past": 0.0, "future": 0.0}, 30.0, ())) == {"past", "future"}
    assert pending(entries, {"past": 30.0, "future": 30.0}, 30.0, ()) == {}


def test_a_claim_reserved_again_is_a_new_entry():
    assert stamps({"a": Reservation(1, 2, 3.0)}) != stamps({"a": Reservation(1, 2, 4.0)})


def test_reservations_count_as_used_in_the_verdict():
    quota = {"metadata": {"name": "gpu"}, "spec": {"hard": {CORE_QUOTA: "1000", MEMORY_QUOTA: "8192"}}}
    review = {"uid": "u", "operation": "CREATE", "namespace": "ns", "kind": {"group": "resource.k8s.io", "kind": "ResourceClaim"},
              "object": {"metadata": {"name": "c"}, "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                  "deviceClassName": SHARED_CLASS, "capacity": {"requests": {"core": "400", "memory": "1024"}}}}]}}}}
    assert claim_admission(review, [], [quota], reserved=Usage(600, 0)) == (True, "")
    allowed, message = claim_admission(review, [], [quota], reserved=Usage(700, 0))
    assert not allowed and "gpu.qgpu.io/core used 700 + requested 400 > hard 1000" in message


def test_the_claim_route_answers_the_verdict_with_its_code():
    import json

    from qgpu_runtime.webhook import cli
    from qgpu_runtime.webhook.admission import WebhookConfig
    from qgpu_runtime.webhook.quota import Verdict

    seen = []

    def check(request):
        seen.append(request["uid"])
        return Verdict(False, "qgpu: the apiserver answered 503", 500)

    route = cli.routes(WebhookConfig(), None, check).post["/validate-claim"]
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u1", "operation": "CREATE"}}
    status, answer = route("", json.dumps(body).encode())
    assert status == 200 and seen == ["u1"]
    assert answer["response"] == {"uid": "u1", "allowed": False,
                                  "status": {"code": 500, "reason": "InternalError", "message": "qgpu: the apiserver answered 503"}}
    assert route("", b"[]")[0] == 400
