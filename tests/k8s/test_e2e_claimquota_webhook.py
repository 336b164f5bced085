"""The claim quota served: `qgpu webhook serve --dra` registered for ResourceClaim CREATEs with the
real kube-apiserver v1.37 (docs/dra.md, "Quota on GPU core and memory").

Refusals carry the figures; many claims created at the same moment never pass the hard limit,
through one webhook, two webhook processes behind one address, and two replicas' worth of locks
sharing the ledger Lease; claims the resourceclaim
controller makes from templates are held to the same quota, and the pod whose claim is refused
stays pending with the controller's event; an apiserver refusal is a 500 naming it."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract.dra import SHARED_CLASS
from qgpu_runtime.contract.leases import ledger_name, parse_ledger
from qgpu_runtime.contract.names import CLAIM_RESERVATIONS
from qgpu_runtime.kube.client import api_client
from qgpu_runtime.webhook.claimquota import CORE_QUOTA, MEMORY_QUOTA
from qgpu_runtime.webhook.quota import ClaimQuota
from tests.k8s.controlplane import QgpuServer, free_port, kubeconfig
from tests.polling import poll

LABEL = "qgpu-test-claim-quota"


def _claim(name: str, core: int, memory: int = 1024) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": _claim_spec(core, memory)}


def _claim_spec(core: int, memory: int) -> dict:
    return {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": SHARED_CLASS, "capacity": {"requests": {"core": str(core), "memory": str(memory)}}}}]}}


def _quota(core: int, memory: int = 1 << 20) -> dict:
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpu"},
            "spec": {"hard": {CORE_QUOTA: str(core), MEMORY_QUOTA: str(memory)}}}


def _review(ns: str, name: str, core: int) -> dict:
    return {"uid": str(uuid.uuid4()), "operation": "CREATE", "namespace": ns, "name": name,
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"}, "object": _claim(name, core)}


def _stored_core(resource: client.ResourceV1Api, ns: str) -> int:
    items = json.loads(resource.list_namespaced_resource_claim(ns, _preload_content=False).data)["items"]
    return sum(int(c["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["core"].replace("k", "000"))
               for c in items)


class Hook:
    def __init__(self, cluster: Any, ledger_ns: str, selector: dict[str, str], port: int):
        self.cluster = cluster
        self.ledger_ns = ledger_ns
        self.selector = selector
        self.port = port
        self.resource = client.ResourceV1Api(cluster.api_client)

    def namespace(self, quota_core: int | None = None) -> str:
        ns = self.cluster.namespace()
        self.cluster.api.patch_namespace(ns, {"metadata": {"labels": self.selector}})
        if quota_core is not None:
            self.cluster.api.create_namespaced_resource_quota(ns, _quota(quota_core))
        return ns

    def create(self, ns: str, name: str, core: int) -> None:
        self.resource.create_namespaced_resource_claim(ns, _claim(name, core), _preload_content=False)


@pytest.fixture(scope="module")
def hook(cluster, request) -> Iterator[Hook]:
    """The webhook as the role runs it; ``request.param`` (indirect parametrization): its --http2."""
    cp = cluster.cp
    ledger_ns = cluster.namespace()
    pair = cp.ca.issue("webhook-claim-quota", "qgpu-webhook", server=True, hosts=("127.0.0.1",))
    port = free_port()
    server = QgpuServer("qgpu-webhook-claim-quota", [
        "webhook", "serve", "--address", "127.0.0.1", "--port", str(port), "--tls-cert-file", str(pair.cert),
        "--tls-private-key-file", str(pair.key), "--dra", "--kubeconfig", str(cp.admin_kubeconfig),
        "--quota-ledger-namespace", ledger_ns, "--claim-reservation-seconds", "30", *cp.webhook_auth_args(),
        "--http2", getattr(request, "param", "off")], cp.workdir, port, "https", cp.ca.cert_path, client_cert=cp.webhook_client)
    server.start(ready_path="/healthz")
    api = client.AdmissionregistrationV1Api(cluster.api_client)
    selector = {LABEL: uuid.uuid4().hex[:8]}
    name = f"qgpu-claim-quota-{selector[LABEL]}"
    api.create_validating_webhook_configuration(_configuration(name, f"{server.url}/validate-claim", cp.ca.pem, selector))
    h = Hook(cluster, ledger_ns, selector, port)
    try:
        _wait_until_active(h)
        yield h
    finally:
        api.delete_validating_webhook_configuration(name)
        server.stop()


def _configuration(name: str, url: str, ca: bytes, selector: dict[str, str]) -> dict:
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration", "metadata": {"name": name},
            "webhooks": [{"name": "claim-quota.qgpu.io", "admissionReviewVersions": ["v1"], "sideEffects": "NoneOnDryRun",
                          "failurePolicy": "Fail", "timeoutSeconds": 10, "namespaceSelector": {"matchLabels": selector},
                          "clientConfig": {"url": url, "caBundle": base64.b64encode(ca).decode()},
                          "rules": [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["*"], "operations": ["CREATE"],
                                     "resources": ["resourceclaims"]}]}]}


def _wait_until_active(h: Hook) -> None:
    """The apiserver picks the configuration up through a watch: probe with dry-run claims over a zero quota."""
    ns = h.namespace(quota_core=0)
    deadline = time.monotonic() + 30
    while True:
        try:
            h.resource.create_namespaced_resource_claim(ns, _claim("probe", 100), dry_run="All", _preload_content=False)
        except ApiException as exc:
            if exc.status == 422:
                return
            raise
        assert time.monotonic() < deadline, "webhook never became active"
        time.sleep(0.5)


def test_a_claim_beyond_the_quota_is_refused_with_the_figures(hook):
    ns = hook.namespace(quota_core=1000)
    hook.create(ns, "first", 600)
    with pytest.raises(ApiException) as refused:
        hook.create(ns, "second", 600)
    assert refused.value.status == 422
    message = json.loads(refused.value.body)["message"]
    assert (f"qgpu: ResourceClaim {ns}/second: exceeded quota 'gpu' in namespace '{ns}': "
            "gpu.qgpu.io/core used 600 + requested 600 > hard 1000 (thousandths of a card)") in message
    hook.create(ns, "third", 400)  # what is left still fits
    # the ledger holds no reservation for claims that are stored: they count themselves
    lease = client.CoordinationV1Api(hook.cluster.api_client).read_namespaced_lease(ledger_name(ns), hook.ledger_ns)
    assert set(parse_ledger(lease.metadata.annotations[CLAIM_RESERVATIONS])) <= {"first", "third"}


def test_a_dry_run_is_judged_and_reserves_nothing(hook):
    ns = hook.namespace(quota_core=1000)
    for _ in range(3):
        hook.resource.create_namespaced_resource_claim(ns, _claim("dry", 600), dry_run="All", _preload_content=False)
    with pytest.raises(ApiException) as refused:
        hook.resource.create_namespaced_resource_claim(ns, _claim("dry", 1200), dry_run="All", _preload_content=False)
    assert "requested 1200 > hard 1000" in json.loads(refused.value.body)["message"]
    with pytest.raises(ApiException) as absent:
        client.CoordinationV1Api(hook.cluster.api_client).read_namespaced_lease(ledger_name(ns), hook.ledger_ns)
    assert absent.value.status == 404


def test_a_namespace_without_a_qgpu_quota_is_not_judged(hook):
    ns = hook.namespace()
    for i in range(3):
        hook.create(ns, f"c{i}", 1000)


def _race(n: int, attempt: Callable[[int], bool]) -> list[int]:
    """``attempt(i)`` from ``n`` threads released at the same moment; the indexes that were admitted."""
    barrier = threading.Barrier(n)
    admitted: list[int] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            if attempt(i):
                admitted.append(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return admitted


@pytest.mark.parametrize("hook", ["off", "on"], indirect=True, ids=["http1", "http2"])
def test_many_claims_created_at_once_never_pass_the_hard_limit(hook):
    """Over HTTP/2 too: kube-apiserver opens more streams in its first flight than the webhook
    handles at once (3), and they wait for a handler instead of closing the connection."""
    ns = hook.namespace(quota_core=2000)
    refusals: list[str] = []

    def create(i: int) -> bool:
        try:
            hook.create(ns, f"c{i}", 300)
            return True
        except ApiException as exc:
            refusals.append(json.loads(exc.body)["message"])
            return False

    admitted = _race(24, create)
    assert len(admitted) * 300 <= 2000
    assert _stored_core(hook.resource, ns) <= 2000
    assert len(admitted) == 6, refusals  # and nothing fit was refused: every refusal is the quota's
    assert all("exceeded quota 'gpu'" in m for m in refusals), refusals


def test_two_replicas_sharing_the_ledger_never_pass_the_hard_limit(hook):
    """Two ClaimQuota instances (each its own namespace locks, as two webhook processes) judge the
    same namespace's CREATEs at once; an admitted claim is stored 0.2 s later, as the apiserver would
    after the rest of the admission chain. Without the ledger both would admit against the same list
    (checked by hand: all 20 admitted)."""
    ns = hook.cluster.namespace()  # not selected by the registered webhook: the two replicas here decide
    hook.cluster.api.create_namespaced_resource_quota(ns, _quota(2500))
    kubeconfig_path = str(hook.cluster.cp.admin_kubeconfig)
    replicas = [ClaimQuota(api_client(kubeconfig_path), hook.ledger_ns) for _ in range(2)]

    def admit_and_store(i: int) -> bool:
        verdict = replicas[i % 2](_review(ns, f"c{i}", 400))
        assert verdict.code == 422 or verdict.allowed, verdict
        if verdict.allowed:
            time.sleep(0.2)  # the rest of the admission chain: the claim is not visible yet
            hook.create(ns, f"c{i}", 400)
        return verdict.allowed

    admitted = _race(20, admit_and_store)
    assert len(admitted) == 6  # 6 × 400 = 2400 <= 2500 < 7 × 400
    assert _stored_core(hook.resource, ns) == 2400


class RoundRobin:
    """A TCP proxy handing each connection to the next of ``ports`` in turn, TLS passed through:
    what a Service in front of two webhook replicas does for the apiserver's connections."""

    def __init__(self, ports: list[int]):
        self.ports = ports
        self.served = [0] * len(ports)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        turn = 0
        while not self.stopped:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            index = turn % len(self.ports)
            turn += 1
            self.served[index] += 1
            upstream = socket.create_connection(("127.0.0.1", self.ports[index]))
            for a, b in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopped = True
        self.listener.close()


def test_two_webhook_processes_behind_one_address_never_pass_the_hard_limit(hook):
    """A second `qgpu webhook serve --dra` sharing the ledger namespace, both behind a round-robin
    proxy registered as one entry: the apiserver's concurrent CREATEs are judged by both."""
    cp = hook.cluster.cp
    pair = cp.ca.issue("webhook-claim-quota-2", "qgpu-webhook", server=True, hosts=("127.0.0.1",))
    port = free_port()
    second = QgpuServer("qgpu-webhook-claim-quota-2", [
        "webhook", "serve", "--address", "127.0.0.1", "--port", str(port), "--tls-cert-file", str(pair.cert),
        "--tls-private-key-file", str(pair.key), "--dra", "--kubeconfig", str(cp.admin_kubeconfig),
        "--quota-ledger-namespace", hook.ledger_ns, *cp.webhook_auth_args()], cp.workdir, port, "https", cp.ca.cert_path)
    second.start(ready_path="/healthz")
    proxy = RoundRobin([hook.port, port])
    selector = {LABEL: uuid.uuid4().hex[:8]}
    admission = client.AdmissionregistrationV1Api(hook.cluster.api_client)
    name = f"qgpu-claim-quota-rr-{selector[LABEL]}"
    admission.create_validating_webhook_configuration(_configuration(name, f"https://127.0.0.1:{proxy.port}/validate-claim",
                                                                     cp.ca.pem, selector))
    try:
        both = Hook(hook.cluster, hook.ledger_ns, selector, hook.port)
        _wait_until_active(both)
        ns = both.namespace(quota_core=2000)

        def create(i: int) -> bool:
            try:
                both.create(ns, f"c{i}", 300)
                return True
            except ApiException as exc:
                assert "exceeded quota 'gpu'" in json.loads(exc.body)["message"], exc.body
                return False

        admitted = _race(24, create)
        assert len(admitted) == 6 and _stored_core(both.resource, ns) == 1800
        assert all(proxy.served), proxy.served  # both replicas took connections
    finally:
        admission.delete_validating_webhook_configuration(name)
        proxy.stop()
        second.stop()


def test_the_apiservers_refusal_is_a_500_naming_it(hook):
    cp = hook.cluster.cp
    pair = cp.ca.issue("no-rbac-quota", "qgpu-webhook-without-rbac", client=True)
    config = cp._write_yaml("no-rbac-quota.kubeconfig", kubeconfig(cp.server, cp.ca.cert_path, pair, "qgpu-webhook-without-rbac"))
    verdict = ClaimQuota(api_client(str(config)), hook.ledger_ns)(_review("team-x", "c", 100))
    assert (verdict.allowed, verdict.code) == (False, 500)
    assert verdict.message.startswith("qgpu: ResourceClaim team-x/c: the GPU quota cannot be checked, so the claim is refused "
                                      "(fail closed; try again): listing ResourceQuotas of namespace 'team-x': the apiserver "
                                      "answered 403 Forbidden: "), verdict.message
    assert 'cannot list resource "resourcequotas"' in verdict.message


def test_claims_from_templates_are_held_to_the_quota_and_the_refused_pod_stays_pending(hook):
    cp = hook.cluster.cp
    ns = hook.namespace(quota_core=1000)
    hook.resource.create_namespaced_resource_claim_template(ns, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "qgpu-c600"},
        "spec": {"spec": _claim_spec(600, 1024)}})
    cp._spawn("kcm-claim-quota", [str(cp.bindir / "kube-controller-manager"), f"--kubeconfig={cp.admin_kubeconfig}",
                                  "--controllers=resourceclaim-controller", "--leader-elect=false", "--secure-port=0"])
    try:
        for pod in ("a", "b"):
            hook.cluster.api.create_namespaced_pod(ns, {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
                "spec": {"schedulerName": "nobody", "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "qgpu-c600"}],
                         "containers": [{"name": "c", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}]}})
            if pod == "a":
                poll(lambda: _claim_of(hook, ns, "a"), timeout=60, interval=0.5, what="pod a's claim")

        def refusal_event() -> str | None:
            events = hook.cluster.api.list_namespaced_event(ns, field_selector="involvedObject.name=b").items
            return next((f"{e.reason}: {e.message}" for e in events if "exceeded quota" in (e.message or "")), None)

        event = poll(refusal_event, timeout=60, interval=0.5, what="the refusal event of pod b")
        assert event.startswith("FailedResourceClaimCreation: "), event
        assert "gpu.qgpu.io/core used 600 + requested 600 > hard 1000" in event
        pod_b = hook.cluster.api.read_namespaced_pod("b", ns)
        assert pod_b.status.phase == "Pending" and not _claim_of(hook, ns, "b")
    finally:
        cp._stop_process("kcm-claim-quota")


def _claim_of(hook: Hook, ns: str, pod: str) -> str | None:
    statuses = hook.cluster.api.read_namespaced_pod(pod, ns).status.resource_claim_statuses or []
    return next((s.resource_claim_name for s in statuses if s.resource_claim_name), None)
