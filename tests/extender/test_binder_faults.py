"""Bind against an apiserver that fails: refused connections, 500s and silence. Real sockets stand
in for the broken apiserver (it is the one boundary we cannot make fail on demand otherwise); the
binder must retry with backoff, then give up with a message naming the pod, and leave no booking."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.extender.binder import Binder, BindError
from qgpu_runtime.kube.retry import is_transient, with_backoff
from qgpu_runtime.model.requests import DEFAULT_LIMITS, parse_pod
from qgpu_runtime.placement import engine
from tests.extender.test_kube_cache import SEC, bind_locally, cache, node, pod
from tests.recordkeys import SIGNER


def api_at(url: str) -> client.CoreV1Api:
    configuration = client.Configuration(host=url)
    configuration.retries = False  # count our own retries, not urllib3's
    return client.CoreV1Api(client.ApiClient(configuration))


class Served:
    """A real HTTP server on a free loopback port, serving ``handler`` until :meth:`close`."""

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Answering(Served):
    """A real HTTP server that answers every request with one status, counting requests."""

    def __init__(self, status: int):
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # noqa: ANN002
                pass

            def _answer(self) -> None:
                outer.requests += 1
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status,
                                   "message": f"etcd is sad ({status})"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = _answer

        self._serve(Handler)


@pytest.fixture
def filtered():
    """A cache whose filter has seen pod p (so bind goes straight to the Binding call)."""
    c = cache()
    p = pod("p")
    c.filter(p, parse_pod(p), ["a", "b"], now_ns=time.time_ns())
    return c, p


def bind_fails(url: str, c, match: str, *, attempts: int, timeout=(0.5, 2), name: str = "p", uid: str = "uid-p",
               node: str = "a") -> None:
    """A Binder against ``url`` fails to bind pod ns/``name`` with a BindError matching ``match``."""
    binder = Binder(api_at(url), c, DEFAULT_LIMITS, attempts=attempts, timeout=timeout, signer=SIGNER)
    with pytest.raises(BindError, match=match):
        binder.bind("ns", name, uid, node)


def test_refused_connections_are_retried_then_reported_and_the_cards_released(filtered):
    c, p = filtered
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    bind_fails(f"http://127.0.0.1:{port}", c, "pod ns/p: binding to a failed .* whether it landed cannot be read",
               attempts=3, timeout=(0.5, 0.5))
    released_after_the_assume_timeout(c)


def released_after_the_assume_timeout(c) -> None:
    """A bind whose outcome could not be read keeps its cards (it may have landed, its answer
    lost) until the pod is filtered again, deleted or --assume-timeout passes."""
    assert c.booking("ns/p") is not None
    c.expire(time.time_ns() + c.assume_ttl_ns + SEC)
    assert c.booking("ns/p") is None


def test_server_errors_are_retried_with_backoff_and_the_message_is_passed_on(filtered):
    c, p = filtered
    server = Answering(503)
    try:
        bind_fails(server.url, c, r"503 etcd is sad", attempts=3)
        assert server.requests == 3 + 1  # and one GET: did any of them land?
    finally:
        server.close()
    released_after_the_assume_timeout(c)


def test_client_errors_are_not_retried(filtered):
    c, p = filtered
    server = Answering(403)
    try:
        bind_fails(server.url, c, "403", attempts=3)
        assert server.requests == 1 + 1  # the POST, and the GET asking whether it landed
    finally:
        server.close()


def test_an_apiserver_that_never_answers_times_out(filtered):
    c, p = filtered
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts connections (the kernel does) and never says a word
    try:
        started = time.monotonic()
        bind_fails(f"http://127.0.0.1:{silent.getsockname()[1]}", c, "pod ns/p", attempts=2, timeout=(0.5, 0.5))
        assert time.monotonic() - started < 10
    finally:
        silent.close()
    released_after_the_assume_timeout(c)


class LandsUnanswered(Served):
    """An apiserver whose Binding lands (the pod bound with its annotations) while the answer is a
    503 (the answer lost, and every retry failing before it reached the store); a GET of the pod
    shows it bound, or unbound with ``lands`` False, or ``shows`` whatever the POSTs did."""

    def __init__(self, p: dict, lands: bool = True, shows: dict | None = None):
        self.bound: dict | None = shows
        self.posts = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # noqa: ANN002
                pass

            def _send(self, status: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                outer.posts += 1
                binding = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                if lands and outer.bound is None:
                    meta = {**p["metadata"], "annotations": binding["metadata"].get("annotations", {})}
                    outer.bound = {**p, "metadata": meta, "spec": {**p["spec"], "nodeName": binding["target"]["name"]}}
                self._send(503, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503, "message": "busy"})

            def do_GET(self) -> None:  # noqa: N802
                self._send(200, outer.bound or p)

        self._serve(Handler)


def test_a_binding_that_landed_while_every_answer_was_lost_keeps_its_cards_and_is_bound(filtered):
    """The Binding lands, its answer is lost and the retries fail: the cards were released and the
    node's Lease entry withdrawn, and another bind took the same cards while the pod ran on them
    (helper audit, 2026-12-01). The pod as the apiserver has it now decides: bound here, the bind
    succeeded and its record is booked."""
    c, p = filtered
    server = LandsUnanswered(p)
    try:
        binder = Binder(api_at(server.url), c, DEFAULT_LIMITS, attempts=2, timeout=(0.5, 2), signer=SIGNER)
        outcome = binder.bind("ns", "p", "uid-p", "a")
    finally:
        server.close()
    assert outcome.node == "a" and outcome.record is not None
    booking = c.booking("ns/p")
    assert booking is not None and booking.node == "a"
    c.expire(time.time_ns() + c.assume_ttl_ns + SEC)
    assert c.booking("ns/p") is not None  # a bound pod's record, not an assumed bind: it stays


def test_a_binding_that_did_not_land_releases_its_cards_once_the_pod_is_read_unbound(filtered):
    c, p = filtered
    server = LandsUnanswered(p, lands=False)
    try:
        bind_fails(server.url, c, "pod ns/p: binding to a failed, cards released", attempts=2)
    finally:
        server.close()
    assert c.booking("ns/p") is None


def test_unknown_pod_is_a_clear_error():
    c = cache()
    server = Answering(404)
    try:
        bind_fails(server.url, c, "pod ns/ghost: cannot read it \\(404", attempts=2, name="ghost", uid="")
    finally:
        server.close()


def test_backoff_doubles_is_capped_and_stops_on_permanent_errors():
    delays: list[float] = []
    calls = iter([ApiException(status=503), ApiException(status=500), ApiException(status=429), "ok"])

    def flaky() -> str:
        item = next(calls)
        if isinstance(item, Exception):
            raise item
        return item

    assert with_backoff(flaky, attempts=5, base_s=1.0, cap_s=3.0, sleep=delays.append) == "ok"
    assert len(delays) == 3
    assert 0.5 <= delays[0] <= 1.0 and 1.0 <= delays[1] <= 2.0 and 1.5 <= delays[2] <= 3.0
    assert not is_transient(ApiException(status=409)) and is_transient(ConnectionResetError())
    with pytest.raises(ApiException):
        with_backoff(lambda: (_ for _ in ()).throw(ApiException(status=422)), sleep=delays.append)
    assert len(delays) == 3


class CallingBack(Answering):
    """Answers every request with ``status``, after running ``before`` (what the watch delivers
    while the Binding is in flight)."""

    def __init__(self, status: int, before):
        super().__init__(status)
        handler = self.httpd.RequestHandlerClass
        answer = handler._answer

        def _answer(request_handler) -> None:
            before()
            answer(request_handler)

        handler.do_POST = _answer


def test_a_failed_bind_of_a_replaced_pod_leaves_the_new_pods_cards_booked():
    """P1's Binding is in flight when P1 is deleted and created again under its name (as a
    StatefulSet does), and the new pod is bound and booked; then P1's Binding fails. Releasing
    the name's booking then freed the new pod's card, and the next whole-card pod was given it."""
    c = cache()
    c.replace_nodes([node("a", n_cards=1), node("b", n_cards=1)])
    first = pod("p", core=100, memory=0, uid="uid-1")
    c.filter(first, parse_pod(first), ["a"], now_ns=time.time_ns())

    def replaced() -> None:
        c.apply_pod("DELETED", first)
        second = pod("p", core=100, memory=0, uid="uid-2")
        c.apply_pod("MODIFIED", bind_locally(c, second, "b", time.time_ns()))

    server = CallingBack(503, replaced)
    try:
        bind_fails(server.url, c, "pod ns/p: binding to a failed", attempts=1, uid="uid-1")
    finally:
        server.close()
    booking = c.booking("ns/p")
    assert booking is not None and booking.node == "b"  # the new pod's, kept
    q = pod("q", core=100, memory=0)
    with pytest.raises(engine.Unschedulable):
        c.reserve(q, parse_pod(q), "b", time.time_ns())


def test_a_second_bind_of_a_pod_while_its_first_runs_is_refused_and_leaves_the_first_alone(filtered):
    """kube-scheduler gives up on a bind after its httpTimeout (30 s) while the extender's retries
    run longer, and binds the pod again: the second bind unpinned and released the first one's
    booking while the first could still land (helper audit, 2026-12-01)."""
    c, p = filtered
    binder = Binder(api_at("http://127.0.0.1:9"), c, DEFAULT_LIMITS, attempts=1, timeout=(0.5, 0.5), signer=SIGNER)
    binder._in_flight.add("ns/p")  # the first bind, still running
    with pytest.raises(BindError, match="pod ns/p: another bind of this pod is in flight"):
        binder.bind("ns", "p", "uid-p", "a")
    assert c.booking("ns/p") is not None  # filter's hold, untouched


def test_a_bind_of_a_pod_the_watch_shows_bound_asks_the_apiserver_and_books_nothing_new(filtered):
    """Filter's copy of the pod is unbound, the watch has since delivered it bound (an earlier
    bind that landed): the bind reads the pod and answers from it instead of choosing cards again
    and releasing the record's booking meanwhile."""
    c, p = filtered
    bound = bind_locally(c, p, "a", time.time_ns())
    c.apply_pod("MODIFIED", bound)
    record = c.booking("ns/p")

    server = LandsUnanswered(p, lands=False, shows=bound)
    try:
        binder = Binder(api_at(server.url), c, DEFAULT_LIMITS, attempts=1, signer=SIGNER)
        outcome = binder.bind("ns", "p", "uid-p", "a")
    finally:
        server.close()
    assert outcome.node == "a" and server.posts == 0
    assert c.booking("ns/p") == record


def test_a_binding_found_landed_with_an_earlier_attempts_record_books_that_record(filtered):
    """The pod is found bound to the node, but with the record of an earlier attempt (its answer
    lost too) rather than this attempt's: this attempt's pin hid the real record from the cache
    for the pod's life, and its real cards looked free (review, 2026-12-01)."""
    c, p = filtered
    earlier = bind_locally(c, p, "a", time.time_ns() - 10 * SEC)  # what an earlier attempt put on the pod
    c.unreserve(p, earlier["metadata"]["annotations"]["qgpu.io/allocation"])
    c.filter(p, parse_pod(p), ["a", "b"], now_ns=time.time_ns())

    server = LandsUnanswered(p, lands=False, shows=earlier)  # every POST answered 503, the GET shows it bound
    try:
        binder = Binder(api_at(server.url), c, DEFAULT_LIMITS, attempts=1, signer=SIGNER)
        outcome = binder.bind("ns", "p", "uid-p", "a")
    finally:
        server.close()
    assert outcome.record == earlier["metadata"]["annotations"]["qgpu.io/allocation"]
    booking = c.booking("ns/p")
    from qgpu_runtime.contract.record import parse_record
    assert booking is not None and booking.containers == parse_record(outcome.record).containers
    assert c._pods.pinned("ns/p") is None  # the bound record rules, not a pin of this attempt's
