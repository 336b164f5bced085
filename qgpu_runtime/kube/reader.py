"""A client for a person's or a pod's credentials, and calls that fail as one clear error.

`qgpu status` (the user's kubeconfig) and the node manager (its pod's ServiceAccount) reach the
apiserver the same way: a kubeconfig if one is named, else the in-cluster config, else
``~/.kube/config``; every call has a timeout, transient failures (5xx, 429, refused or dropped
connections, timeouts) are retried with backoff, and what still fails is raised as one
:class:`ApiCallError` naming the call, the apiserver and the reason, never a bare traceback.
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

from kubernetes import client, config

from qgpu_runtime.kube.client import REQUEST_TIMEOUT
from qgpu_runtime.kube.errors import call, described
from qgpu_runtime.kube.retry import is_transient, with_backoff

T = TypeVar("T")


class ApiCallError(RuntimeError):
    """An API call (or loading the client's configuration) failed; the message says which and why.

    ``transient`` says whether trying again later can help (apiserver down or overloaded) or not
    (forbidden, not found, a bad kubeconfig).
    """

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


def load_client(kubeconfig: str | None, context: str | None, error: type[ApiCallError] = ApiCallError) -> client.ApiClient:
    """An ApiClient for ``kubeconfig``; without one, in-cluster config, then ``~/.kube/config``."""
    try:
        if kubeconfig:
            return config.new_client_from_config(config_file=kubeconfig, context=context)
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(context=context)
        return client.ApiClient()
    except (config.ConfigException, OSError, ValueError) as exc:
        where = f"--kubeconfig {kubeconfig}" if kubeconfig else "in-cluster config, then ~/.kube/config"
        raise error(f"cannot load Kubernetes client configuration ({where}): {exc}", transient=False) from exc


class ApiCaller:
    """Calls through one ApiClient with backoff; every failure becomes one ``error`` naming the call."""

    def __init__(self, api_client: client.ApiClient, *, timeout: tuple[float, float] = REQUEST_TIMEOUT,
                 attempts: int = 3, error: type[ApiCallError] = ApiCallError) -> None:
        self.api_client = api_client
        self.server = str(api_client.configuration.host)
        self.timeout = timeout
        self.attempts = attempts
        self.error = error

    def __call__(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return with_backoff(lambda: call(fn), attempts=self.attempts, base_s=0.2, cap_s=2.0)
        except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
            transient = is_transient(exc)
            tries = f" after {self.attempts} attempts" if transient else ""
            raise self.error(f"{what} at {self.server}{tries}: {described(exc)}", transient=transient) from exc

    def items(self, what: str, fn: Callable[[], Any]) -> list[dict[str, Any]]:
        """The ``items`` of a LIST made with ``_preload_content=False``, as API JSON."""
        return list(json.loads(self(what, fn).data).get("items", []))


class ClusterReader:
    """What ``qgpu status`` reads of a cluster: every node and every pod, as API JSON."""

    def __init__(self, kubeconfig: str | None = None, context: str | None = None, *,
                 timeout: tuple[float, float] = REQUEST_TIMEOUT, attempts: int = 3) -> None:
        self.calls = ApiCaller(load_client(kubeconfig, context), timeout=timeout, attempts=attempts)
        self._core = client.CoreV1Api(self.calls.api_client)

    def list_pods(self) -> list[dict[str, Any]]:
        return self.calls.items("listing pods", lambda: self._core.list_pod_for_all_namespaces(
            _preload_content=False, _request_timeout=self.calls.timeout))

    def list_nodes(self) -> list[dict[str, Any]]:
        return self.calls.items("listing nodes", lambda: self._core.list_node(
            _preload_content=False, _request_timeout=self.calls.timeout))

    def pod_proxy_get(self, namespace: str, pod: str, port: int, path: str, limit: int) -> str:
        """GET ``path`` of a pod's ``port`` through the apiserver's pod proxy (``pods/proxy``, the
        caller's own credentials), at most ``limit`` bytes of body (more raises)."""
        def fetch() -> bytes:
            response = self._core.connect_get_namespaced_pod_proxy_with_path(
                f"{pod}:{port}", namespace, path, _preload_content=False, _request_timeout=self.calls.timeout)
            try:
                return response.read(limit + 1)
            finally:
                response.release_conn()
        body = self.calls(f"reading {path} of pod {namespace}/{pod} port {port} through the apiserver's proxy", fetch)
        if len(body) > limit:
            raise ApiCallError(f"pod {namespace}/{pod} port {port} /{path}: more than {limit} bytes", transient=False)
        return body.decode("utf-8", errors="replace")
