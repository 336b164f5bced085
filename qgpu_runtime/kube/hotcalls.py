"""The extender's per-pod API calls (Lease GET/PUT/POST, Binding POST) without the generated client.

Each generated method of the ``kubernetes`` package checks its arguments, builds and sanitises model
objects, serialises the request through ``param_serialize`` and wraps the answer: about 0.25 ms of
CPU per call on the 2-core dev machine over a plain request on the same connection pool
(docs/benchmarks.md, issue 23). The binder makes one or two such calls per GPU pod, so these go
straight to the ``ApiClient``'s own urllib3 pool: the same connections, TLS settings (client
certificates included) and retries, the same ``Authorization`` header (asked of the configuration
per call, so a rotating in-cluster token or an exec plugin's refresh still applies). Failures are
raised exactly as the generated methods raise them (:class:`ApiException` with status, reason
and body; urllib3's errors as they are), so :func:`qgpu_runtime.kube.errors.call` maps both.
"""

from __future__ import annotations

import json
from typing import Any, Mapping
from urllib.parse import quote

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

Timeout = tuple[float, float]


def _segment(value: str) -> str:
    return quote(value, safe="")


class HotCalls:
    """Typed JSON calls on ``api_client``'s pool; each returns the decoded answer (or nothing)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.configuration = api_client.configuration
        self.pool = api_client.rest_client.pool_manager
        # the server's URL parsed once: each call asks the manager for the host's connection pool
        # (the one every other call of this client uses) and sends the path on it, skipping the
        # manager's parse of a whole URL and its redirect handling (an apiserver answers these
        # calls without redirects; a 3xx is raised like any other status)
        url = urllib3.util.parse_url(self.configuration.host)
        self._origin = (url.scheme or "https", url.host, url.port)
        self._prefix = (url.path or "").rstrip("/")

    def _headers(self, with_body: bool) -> dict[str, str]:
        headers = dict(self.api_client.default_headers)
        headers["Accept"] = "application/json"
        if with_body:
            headers["Content-Type"] = "application/json"
        for setting in self.configuration.auth_settings().values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[setting["key"]] = setting["value"]
        return headers

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None, timeout: Timeout) -> bytes:
        scheme, host, port = self._origin
        response = self.pool.connection_from_host(host, port, scheme).urlopen(
            method, self._prefix + path, body=json.dumps(body, separators=(",", ":")) if body is not None else None,
            headers=self._headers(body is not None), preload_content=True, assert_same_host=False, redirect=False,
            timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]))
        data = response.data
        if not 200 <= response.status <= 299:
            raise ApiException(status=response.status, reason=response.reason, body=data.decode("utf-8", "replace"))
        return data

    def read_lease(self, namespace: str, name: str, timeout: Timeout) -> dict[str, Any]:
        return json.loads(self._request(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{_segment(namespace)}/leases/{_segment(name)}", None, timeout))

    def create_lease(self, namespace: str, body: Mapping[str, Any], timeout: Timeout) -> dict[str, Any]:
        return json.loads(self._request("POST", f"/apis/coordination.k8s.io/v1/namespaces/{_segment(namespace)}/leases",
                                        body, timeout))

    def replace_lease(self, namespace: str, name: str, body: Mapping[str, Any], timeout: Timeout) -> dict[str, Any]:
        return json.loads(self._request(
            "PUT", f"/apis/coordination.k8s.io/v1/namespaces/{_segment(namespace)}/leases/{_segment(name)}", body, timeout))

    def create_binding(self, namespace: str, name: str, body: Mapping[str, Any], timeout: Timeout) -> None:
        self._request("POST", f"/api/v1/namespaces/{_segment(namespace)}/pods/{_segment(name)}/binding", body, timeout)
