"""ClaimQuota (webhook/quota.py) with stand-in API objects: the order of reads, what is reserved,
conflicts, and every way the check cannot be made, each a 500 naming the call (fail closed).
The same against the real kube-apiserver: tests/k8s/test_e2e_claimquota_webhook.py."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract.dra import SHARED_CLASS, WHOLE_CLASS
from qgpu_runtime.contract.leases import Reservation, encode_ledger, parse_ledger
from qgpu_runtime.contract.names import CLAIM_RESERVATIONS
from qgpu_runtime.webhook.claimquota import CORE_QUOTA, MEMORY_QUOTA
from qgpu_runtime.webhook.dra import CardSizesUnavailable
from qgpu_runtime.webhook.quota import ClaimQuota, Verdict

NS = "team-a"


class Response:
    """A ``_preload_content=False`` answer: read in chunks, closed or released as urllib3's."""

    def __init__(self, doc: Any):
        self.data = json.dumps(doc).encode()
        self.body = io.BytesIO(self.data)
        self.closed = False

    def read(self, amt: int | None = None) -> bytes:
        return self.body.read(amt)

    def close(self) -> None:
        self.closed = True

    def release_conn(self) -> None:
        pass


def page(items: list, limit: int | None = None, _continue: str | None = None, **_: Any) -> Response:
    """One page of a LIST as the apiserver pages it: ``limit`` items from the ``continue`` token."""
    start = int(_continue or 0)
    end = len(items) if limit is None else min(len(items), start + limit)
    return Response({"items": items[start:end], "metadata": {"continue": str(end) if end < len(items) else ""}})


def claim(name: str, core: int) -> dict:
    return {"metadata": {"name": name, "namespace": NS}, "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": SHARED_CLASS, "capacity": {"requests": {"core": str(core), "memory": "1024"}}}}]}}}


def review(name: str, core: int, **extra: Any) -> dict:
    return {"uid": "u-" + name, "operation": "CREATE", "namespace": NS, "kind": {"group": "resource.k8s.io", "kind": "ResourceClaim"},
            "object": claim(name, core), **extra}


class FakeApi:
    """Claims, quotas and one ledger Lease, with resourceVersion preconditions; ``fail`` maps a
    call name to the exception it raises."""

    def __init__(self, claims=(), hard_core: int | None = 1000, pods=(), namespace_labels: dict | None = None,
                 hard_memory: int = 65536):
        self.claims = list(claims)
        self.pods = list(pods)
        self.namespace_labels = namespace_labels or {}
        self.quotas = [] if hard_core is None else [{"metadata": {"name": "gpu"}, "spec": {"hard": {CORE_QUOTA: str(hard_core),
                                                                                                     MEMORY_QUOTA: str(hard_memory)}}}]
        self.lease: dict | None = None
        self.version = 0
        self.fail: dict[str, BaseException] = {}
        self.conflicts_to_give = 0
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    def list_namespaced_resource_quota(self, ns, **_):
        self._call("quotas")
        return Response({"items": self.quotas})

    def list_namespaced_resource_claim(self, ns, **kwargs):
        self._call("claims")
        return page(self.claims, **kwargs)

    def list_namespaced_pod(self, ns, **kwargs):
        self._call("pods")
        return page(self.pods, **kwargs)

    def read_namespace(self, name, **_):
        self._call("namespace")
        return Response({"metadata": {"name": name, "labels": self.namespace_labels}})

    def read_namespaced_lease(self, name, ns, **_):
        self._call("read")
        if self.lease is None:
            raise ApiException(status=404, reason="Not Found")
        return Response(self.lease)

    def _store(self, body):
        self.version += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        return Response(self.lease)

    def create_namespaced_lease(self, ns, body, **_):
        self._call("write")
        if self.lease is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        return self._store(body)

    def replace_namespaced_lease(self, name, ns, body, **_):
        self._call("write")
        if self.conflicts_to_give or body["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            self.conflicts_to_give = max(0, self.conflicts_to_give - 1)
            raise ApiException(status=409, reason="Conflict")
        return self._store(body)

    def reservations(self) -> dict[str, Reservation]:
        return parse_ledger(self.lease["metadata"]["annotations"][CLAIM_RESERVATIONS]) if self.lease else {}


def guard(api: FakeApi, now: list[float] | None = None, ticks: list[float] | None = None, **kwargs: Any) -> ClaimQuota:
    """A webhook replica: ``now`` its wall clock, ``ticks`` its monotonic clock (the real one if None)."""
    clock = now if now is not None else [1000.0]
    if ticks is not None:
        kwargs["monotonic"] = lambda: ticks[0]
    quota = ClaimQuota(client.ApiClient(), "qgpu", clock=lambda: clock[0], **kwargs)
    quota.core = quota.resource = quota.leases = api  # type: ignore[assignment]
    return quota


def test_an_admission_reserves_what_the_claim_asks_until_it_is_visible():
    api = FakeApi()
    assert guard(api)(review("a", 600)) == Verdict(True)
    assert api.calls == ["quotas", "read", "claims", "pods", "write"]
    assert api.reservations() == {"a": Reservation(600, 1024, 1030.0)}
    verdict = guard(api)(review("b", 600))
    assert not verdict.allowed and verdict.code == 422 and "used 600 + requested 600 > hard 1000" in verdict.message
    api.claims.append(claim("a", 600))  # stored: the claim counts, its reservation is dropped at the next write
    assert guard(api)(review("c", 400)) == Verdict(True)
    assert set(api.reservations()) == {"c"}


def test_a_reservation_whose_claim_never_appeared_stops_counting_once_this_replica_watched_it_for_the_ttl():
    api = FakeApi()
    ticks = [5.0]
    replica = guard(api, ticks=ticks)
    assert replica(review("lost", 800)).allowed
    assert not replica(review("b", 800)).allowed  # first seen by this replica at tick 5
    ticks[0] = 34.9
    assert not replica(review("b", 800)).allowed
    ticks[0] = 35.0
    assert replica(review("b", 800)).allowed
    assert set(api.reservations()) == {"b"}


def test_a_replica_whose_clock_runs_ahead_neither_erases_nor_over_admits():
    """Issue 21 §6: a replica 45 s ahead judged its peers' reservations (stamped 30 s ahead of their
    own clock) expired, erased them from the ledger and admitted 1,200 of a 1,000 quota."""
    api = FakeApi(hard_core=1000)
    on_time, ahead = guard(api, now=[1000.0], ticks=[0.0]), guard(api, now=[1045.0], ticks=[0.0])
    assert on_time(review("a", 600)) == Verdict(True)
    verdict = ahead(review("b", 600))
    assert not verdict.allowed and "used 600 + requested 600 > hard 1000" in verdict.message
    assert ahead(review("c", 400)) == Verdict(True)
    assert set(api.reservations()) == {"a", "c"}  # the peer's reservation survives the fast replica's write
    assert not on_time(review("d", 1)).allowed


def test_a_reservation_stamped_far_in_the_future_expires_like_any_other():
    api = FakeApi(hard_core=1000)
    api.lease = {"metadata": {"resourceVersion": "1", "annotations": {
        CLAIM_RESERVATIONS: encode_ledger({"future": Reservation(900, 1024, 1e12)})}}}
    ticks = [0.0]
    replica = guard(api, ticks=ticks)
    assert not replica(review("a", 600)).allowed
    ticks[0] = 30.0
    assert replica(review("a", 600)).allowed
    assert set(api.reservations()) == {"a"}


def test_no_qgpu_quota_or_nothing_asked_of_qgpu_costs_one_list_and_writes_nothing():
    api = FakeApi(hard_core=None)
    assert guard(api)(review("a", 5000)) == Verdict(True)
    other = review("b", 0)
    other["object"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.example.com"
    api2 = FakeApi()
    assert guard(api2)(other) == Verdict(True)
    assert api.calls == ["quotas"] and api2.calls == ["quotas"]


def test_a_dry_run_is_judged_and_writes_nothing():
    api = FakeApi()
    assert guard(api)(review("a", 600, dryRun=True)) == Verdict(True)
    assert "write" not in api.calls and api.lease is None
    assert not guard(api)(review("a", 1600, dryRun=True)).allowed


def test_other_operations_are_not_judged():
    api = FakeApi()
    assert guard(api)({**review("a", 5000), "operation": "UPDATE"}) == Verdict(True)
    assert api.calls == []


def test_a_lost_write_is_read_and_judged_again():
    api = FakeApi()
    guard(api)(review("a", 100))
    api.conflicts_to_give = 2
    quota = guard(api)
    assert quota(review("b", 100)) == Verdict(True)
    assert quota.conflicts == 2 and api.calls.count("claims") == 4


@pytest.mark.parametrize("call, exc, words", [
    ("quotas", ApiException(status=403, reason="Forbidden"), "listing ResourceQuotas of namespace 'team-a': the apiserver answered 403 Forbidden"),
    ("claims", ApiException(status=503, reason="Service Unavailable"), "listing ResourceClaims of namespace 'team-a': the apiserver answered 503"),
    ("read", ApiException(status=500, reason="Internal Server Error"), "reading Lease qgpu/qgpu-claim-quota.team-a: the apiserver answered 500"),
    ("write", ApiException(status=422, reason="Unprocessable Entity"), "writing Lease qgpu/qgpu-claim-quota.team-a: the apiserver answered 422"),
    ("claims", TimeoutError("read timed out"), "listing ResourceClaims of namespace 'team-a': the apiserver could not be reached: read timed out"),
])
def test_every_failed_call_is_a_500_naming_it(call, exc, words):
    api = FakeApi()
    api.fail[call] = exc
    verdict = guard(api)(review("a", 100))
    assert (verdict.allowed, verdict.code) == (False, 500)
    assert verdict.message.startswith("qgpu: ResourceClaim team-a/a: the GPU quota cannot be checked, so the claim is refused "
                                      "(fail closed; try again): ")
    assert words in verdict.message, verdict.message


def test_an_unreadable_ledger_is_a_500_saying_to_delete_it():
    api = FakeApi()
    api.lease = {"metadata": {"resourceVersion": "1", "annotations": {CLAIM_RESERVATIONS: "{"}}}
    verdict = guard(api)(review("a", 100))
    assert verdict.code == 500 and "(delete the Lease: the webhook recreates it)" in verdict.message


def test_endless_conflicts_end_with_the_budget():
    api = FakeApi()
    guard(api)(review("a", 100))
    api.conflicts_to_give = 10**6
    quota = guard(api, budget_s=0.3)
    verdict = quota(review("b", 100))
    assert verdict.code == 500 and quota.conflicts > 1
    # whichever call finds the budget spent names it
    assert "writes lost to concurrent admissions within 0.3s" in verdict.message or "no time left of the 0.3s budget" in verdict.message


def test_a_namespace_lock_held_past_the_budget_is_a_500():
    api = FakeApi()
    quota = guard(api, budget_s=0.2)
    with quota.locks.hold(NS, 1.0):  # another admission of the namespace, in this process
        verdict = quota(review("a", 100))
    assert verdict.code == 500 and "none finished within 0.2s" in verdict.message
    assert quota.locks._locks == {}  # dropped once nobody holds or waits for it


def test_the_ledger_round_trip_through_the_fake_is_the_codec():
    api = FakeApi()
    guard(api)(review("a", 100))
    assert api.lease["metadata"]["annotations"][CLAIM_RESERVATIONS] == encode_ledger({"a": Reservation(100, 1024, 1030.0)})


def test_a_claim_deleted_and_created_again_is_reserved_again_until_it_is_listed():
    """The replica remembered "stored" by name: a claim deleted and created again under that name
    was taken for stored at once, and a concurrent claim was admitted beside it past the quota
    (600 + 600 against 1000)."""
    api = FakeApi()  # core 1000
    q = guard(api)
    assert q(review("x", 600)) == Verdict(True)
    api.claims.append(claim("x", 600))  # stored, and listed
    assert not q(review("y", 600)).allowed  # refused: nothing written, the ledger keeps x
    api.claims.clear()  # the tenant deletes x ...
    assert q(review("x", 600)) == Verdict(True)  # ... and creates it again
    refused = q(review("z", 600))  # before the new x is listed
    assert not refused.allowed and "used 600 + requested 600 > hard 1000" in refused.message


def test_another_replicas_reservation_under_a_name_seen_stored_counts():
    """The same across replicas: A saw x stored; B admits x again (a new reservation, its own
    stamp); A must count it until x is listed."""
    api, now = FakeApi(), [1000.0]
    a, b = guard(api, now), guard(api, now)
    assert a(review("x", 600)) == Verdict(True)
    api.claims.append(claim("x", 600))
    assert not a(review("y", 600)).allowed  # A has now seen x stored
    api.claims.clear()
    now[0] += 1.0
    assert b(review("x", 600)) == Verdict(True)
    refused = a(review("z", 600))
    assert not refused.allowed and "used 600 + requested 600 > hard 1000" in refused.message



def whole_claim(name: str) -> dict:
    return {"metadata": {"name": name, "namespace": NS}, "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": WHOLE_CLASS}}]}}}


def test_a_request_naming_no_memory_is_charged_the_largest_card_of_the_pools():
    """A whole card of an H200 pool (140 GiB) was charged the 80 GiB default: a 160 GiB quota
    admitted two, 280 GiB. It is charged the largest card size the pools have (the flag's or the
    published ones), never less than the default; the claims already stored are charged the same."""
    h200 = 143360
    api = FakeApi(hard_core=8000, hard_memory=160 * 1024)
    first = {**review("a", 0), "object": whole_claim("a")}
    assert guard(api, card_sizes=lambda: (16384, h200))(first) == Verdict(True)
    assert api.reservations()["a"].memory_mib == h200
    api.claims.append(whole_claim("a"))
    verdict = guard(api, card_sizes=lambda: (16384, h200))({**review("b", 0), "object": whole_claim("b")})
    assert not verdict.allowed and f"used {h200} + requested {h200} > hard {160 * 1024}" in verdict.message, verdict.message
    # pools of small cards only: the default still (a whole card of a size not published yet stays covered)
    assert guard(FakeApi(hard_core=8000, hard_memory=160 * 1024), card_sizes=lambda: (16384,)).unsized_memory() == 80 * 1024


def test_card_sizes_that_cannot_be_read_refuse_the_admission_as_a_500():
    def unreadable() -> tuple[int, ...]:
        raise CardSizesUnavailable("listing ResourceSlices of driver gpu.qgpu.io: the apiserver could not be reached: boom")

    api = FakeApi()
    verdict = guard(api, card_sizes=unreadable)({**review("a", 0), "object": whole_claim("a")})
    assert not verdict.allowed and verdict.code == 500, verdict
    assert "the card sizes a request naming no memory is charged by: listing ResourceSlices" in verdict.message
    assert "write" not in api.calls
    # once read, a later failure keeps the sizes read last instead of refusing every GPU pod
    answers: list[Any] = [(143360,), CardSizesUnavailable("boom")]

    def blinking() -> tuple[int, ...]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    quota = guard(FakeApi(), card_sizes=blinking)
    assert quota.unsized_memory() == quota.unsized_memory() == 143360


def test_a_whole_card_is_charged_the_largest_card_the_operator_names():
    """Device-plugin pools of H200 cards: --largest-card-memory-mib 143771. Charged the 80 GiB
    default, `nvidia.com/gpu: 2` fitted a 160 GiB memory quota and held about 280 GiB."""
    pod = {"metadata": {"name": "p", "namespace": NS}, "spec": {"containers": [
        {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}
    request = {"uid": "u-p", "operation": "CREATE", "namespace": NS, "kind": {"group": "", "kind": "Pod"}, "object": pod}
    api = FakeApi(hard_core=8000, hard_memory=160 * 1024)
    assert guard(api).check_pod(request) == Verdict(True)  # the default: 2 x 80 GiB fits
    verdict = guard(FakeApi(hard_core=8000, hard_memory=160 * 1024), default_memory_mib=143771).check_pod(request)
    assert not verdict.allowed and f"requested {2 * 143771} > hard {160 * 1024}" in verdict.message, verdict.message
