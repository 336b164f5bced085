"""The extender's per-pod calls without the generated client (``kube/hotcalls.py``), against a local
server that records what it was sent: the path under the configured host's own path, the
credentials asked of the configuration per call, one connection reused, and failures raised as
the generated client raises them."""

from __future__ import annotations

import http.server
import json
import socketserver
import threading
from typing import Any, Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.kube.hotcalls import HotCalls

TIMEOUT = (5.0, 5.0)


class Recorder(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.status, self.answer, self.location = 201, b'{"kind":"Status","status":"Success"}', ""
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Recorder

    def _serve(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.seen.append({"method": self.command, "path": self.path, "body": json.loads(body) if body else None,
                                 "authorization": self.headers.get("authorization"),
                                 "content_type": self.headers.get("content-type"), "port": self.client_address[1]})
        self.send_response(self.server.status)
        if self.server.location:
            self.send_header("Location", self.server.location)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.server.answer)))
        self.end_headers()
        self.wfile.write(self.server.answer)

    do_GET = do_POST = do_PUT = _serve  # noqa: N815 - stdlib naming

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


@pytest.fixture
def server() -> Iterator[Recorder]:
    srv = Recorder()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def calls(srv: Recorder, path: str = "", token: str = "first") -> tuple[HotCalls, client.Configuration]:
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{srv.server_address[1]}{path}"
    configuration.api_key = {"authorization": token}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    return HotCalls(client.ApiClient(configuration)), configuration


def test_a_binding_is_posted_under_the_hosts_path_with_the_credentials_of_the_moment_on_one_connection(server):
    hot, configuration = calls(server, "/cluster-a/")
    hot.create_binding("team a", "pod/1", {"target": {"kind": "Node", "name": "n1"}}, TIMEOUT)
    configuration.api_key = {"authorization": "second"}  # a rotated token applies to the next call
    hot.create_binding("ns", "p", {"target": {"kind": "Node", "name": "n2"}}, TIMEOUT)
    first, second = server.seen
    assert first["method"] == "POST" and first["path"] == "/cluster-a/api/v1/namespaces/team%20a/pods/pod%2F1/binding"
    assert first["body"] == {"target": {"kind": "Node", "name": "n1"}} and first["content_type"] == "application/json"
    assert (first["authorization"], second["authorization"]) == ("Bearer first", "Bearer second")
    assert first["port"] == second["port"]  # the pool's kept-alive connection


def test_lease_calls_decode_the_answer_and_send_no_body_on_a_get(server):
    hot, _ = calls(server)
    server.status, server.answer = 200, b'{"kind":"Lease","metadata":{"name":"n1"}}'
    assert hot.read_lease("qgpu", "n1", TIMEOUT) == {"kind": "Lease", "metadata": {"name": "n1"}}
    assert hot.replace_lease("qgpu", "n1", {"spec": {}}, TIMEOUT)["kind"] == "Lease"
    get, put = server.seen
    assert (get["method"], get["path"], get["body"]) == ("GET", "/apis/coordination.k8s.io/v1/namespaces/qgpu/leases/n1", None)
    assert (put["method"], put["body"]) == ("PUT", {"spec": {}})


@pytest.mark.parametrize("status", [409, 500, 307])
def test_a_status_outside_2xx_is_an_api_exception_with_status_and_body_and_a_redirect_is_not_followed(server, status):
    hot, _ = calls(server)
    server.status, server.answer = status, b'{"kind":"Status","reason":"Conflict"}'
    server.location = f"http://127.0.0.1:{server.server_address[1]}/elsewhere" if status == 307 else ""
    with pytest.raises(ApiException) as caught:
        hot.create_binding("ns", "p", {}, TIMEOUT)
    assert caught.value.status == status and "Conflict" in caught.value.body
    assert [seen["path"] for seen in server.seen] == ["/api/v1/namespaces/ns/pods/p/binding"]
