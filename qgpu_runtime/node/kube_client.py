"""The node manager's only door to the Kubernetes API (pods on this node, annotations, node labels).

Kept small so it can be exercised against a real kube-apiserver fixture (tests/k8s) without
touching the rest of the manager. Responses are read as raw JSON (``_preload_content=False``),
which is both faster than the generated models and the API-JSON shape the rest of qgpu reads.

Every call has a timeout (a hung apiserver must not hang kubelet's Allocate) and is retried with
backoff when the failure is transient (5xx, 429, refused or dropped connections, timeouts). What
still fails is raised as :class:`~qgpu_runtime.node.pods.PodSourceError`, whose message names the
call, the apiserver and the reason — never a bare traceback.

API use, and so the manager's RBAC (templates/kubernetes/qgpu-manager.yaml.j2 grants exactly this):
``pods``: ``list`` and ``watch`` (this node's pods, by field selector: node/podwatch.py's cache) and
``patch`` (``qgpu.io/assigned``);
``nodes``: ``get`` (the isolation-policy label, once at start) and ``patch`` (GPU labels and
annotations of its own node); ``nodes/status``: ``patch`` (HAMi's share sizes, the
``QGPUSharesEnforced`` condition); ``events``: ``create`` (Warning Events when isolation acts on a
pod, and on its Node when shares are not enforced). (``qgpu status``
reads the cluster with the user's own credentials through ``kube/reader.py``, not through this.) With ``--dra``:
``resourceclaims`` (resource.k8s.io) ``get`` (the claims kubelet asks it to prepare) and, through
``KubeSlices``, ``resourceslices`` ``get``, ``watch`` (by name), ``create``, ``update``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, TypeVar

from kubernetes import client

from qgpu_runtime.kube import apijson
from qgpu_runtime.kube.client import REQUEST_TIMEOUT, drain
from qgpu_runtime.kube.errors import NotFound, described
from qgpu_runtime.kube.events import event_body, node_reference
from qgpu_runtime.kube.paging import PageTooLarge, paged_list
from qgpu_runtime.kube.podslim import kept
from qgpu_runtime.kube.reader import ApiCaller, load_client
from qgpu_runtime.node.pods import PodSourceError
from qgpu_runtime.node.podwatch import WatchExpired, watch_event

T = TypeVar("T")

# Said explicitly: the generated client labels every PATCH as a JSON *patch* (a list of operations)
# and only its REST layer quietly rewrites dict bodies; metadata maps merge the same either way.
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"  # lists merge by their key (conditions: type)


class OpenStreams:
    """Watch responses in progress, so ``close`` can cut them when the manager stops."""

    def __init__(self) -> None:
        self._streams: set[Any] = set()
        self._lock = threading.Lock()

    @contextmanager
    def held(self, response: Any) -> Iterator[Any]:
        with self._lock:
            self._streams.add(response)
        try:
            yield response
        finally:
            with self._lock:
                self._streams.discard(response)
            response.close()

    def close(self) -> None:
        with self._lock:
            streams = list(self._streams)
        for response in streams:
            try:
                response.shutdown()
            except Exception:  # noqa: BLE001 - already closed
                pass


class KubePodSource:
    def __init__(self, kubeconfig: str | None = None, context: str | None = None, *,
                 timeout: tuple[float, float] = REQUEST_TIMEOUT, attempts: int = 3) -> None:
        api_client = load_client(kubeconfig, context, PodSourceError)
        self._calls = ApiCaller(api_client, timeout=timeout, attempts=attempts, error=PodSourceError)
        self.server = self._calls.server
        self.api_client = api_client
        self._core = client.CoreV1Api(api_client)
        self._resource = client.ResourceV1Api(api_client)
        self._timeout = timeout
        self._attempts = attempts
        self._streams = OpenStreams()

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return self._calls(what, fn)

    def pods_on_node(self, node: str) -> list[dict[str, Any]]:
        return self.list_pods_on_node(node)[0]

    def list_pods_on_node(self, node: str) -> tuple[list[dict[str, Any]], str]:
        """This node's pods (what :func:`~qgpu_runtime.kube.podslim.kept` keeps of each) and the
        list's resourceVersion, where a watch of them starts (node/podwatch.py). Read a page at a
        time under kube/paging.py's byte cap: a pod's owner may set ``spec.nodeName``, and pods near
        etcd's object limit decoded together ran the manager out of memory."""
        what = f"listing the pods of node {node}"

        def fetch(limit: int, token: str | None) -> Any:
            return self._call(what, lambda: self._core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node}", limit=limit, _continue=token, _preload_content=False,
                _request_timeout=self._timeout))

        try:
            return paged_list(fetch, kept)
        except PageTooLarge as exc:
            raise PodSourceError(f"{what}: {exc}") from None
        except ValueError as exc:
            raise PodSourceError(f"{what}: the apiserver's answer is not JSON: {exc}") from None

    def watch_pods_on_node(self, node: str, resource_version: str, timeout_s: float,
                           stop: threading.Event) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, pod) events of this node's pods from ``resource_version`` until the apiserver ends
        the watch (after about ``timeout_s``) or ``stop``/``close`` cuts it. Raises
        :class:`~qgpu_runtime.node.podwatch.WatchExpired` when the version is too old (410 Gone)."""
        response = self._call(f"watching the pods of node {node}", lambda: self._core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", watch=True, resource_version=resource_version,
            allow_watch_bookmarks=True, timeout_seconds=max(1, int(timeout_s)), _preload_content=False,
            _request_timeout=(self._timeout[0], timeout_s + 30)))
        with self._streams.held(response):
            try:
                if stop.is_set():
                    return
                for line in response:
                    if line.strip():
                        yield watch_event(line)
            except (WatchExpired, GeneratorExit):
                raise
            except Exception as exc:  # noqa: BLE001 - a cut stream (close, network) is one clear error
                if stop.is_set():
                    return
                raise PodSourceError(f"watching the pods of node {node} at {self.server}: {described(exc)}",
                                     transient=True) from exc

    def close(self) -> None:
        """Cut the pod watches in progress (the manager is stopping)."""
        self._streams.close()

    def patch_pod_annotations(self, namespace: str, name: str, values: Mapping[str, str]) -> None:
        body = {"metadata": {"annotations": dict(values)}}
        drain(self._call(f"patching the annotations of pod {namespace}/{name}", lambda: self._core.patch_namespaced_pod(
            name, namespace, body, _content_type=MERGE_PATCH, _preload_content=False, _request_timeout=self._timeout)))

    def patch_node(self, node: str, labels: Mapping[str, str], annotations: Mapping[str, str]) -> None:
        body = {"metadata": {"labels": dict(labels), "annotations": dict(annotations)}}
        drain(self._call(f"patching the labels and annotations of node {node}", lambda: self._core.patch_node(
            node, body, _content_type=MERGE_PATCH, _preload_content=False, _request_timeout=self._timeout)))

    def patch_node_capacity(self, node: str, capacity: Mapping[str, str]) -> None:
        """Extended resources no device plugin counts, in the Node's status (capacity and
        allocatable, which the kubelet keeps: it recomputes allocatable from capacity)."""
        body = {"status": {"capacity": dict(capacity), "allocatable": dict(capacity)}}
        drain(self._call(f"patching the capacity of node {node}", lambda: self._core.patch_node_status(
            node, body, _content_type=MERGE_PATCH, _preload_content=False, _request_timeout=self._timeout)))

    def node_labels(self, node: str) -> dict[str, str]:
        doc = apijson.loads(self._call(f"reading node {node}", lambda: self._core.read_node(
            node, _preload_content=False, _request_timeout=self._timeout)).data)
        return dict((doc.get("metadata") or {}).get("labels") or {})

    def resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """A ResourceClaim (resource.k8s.io/v1) as API JSON, for the DRA kubelet plugin."""
        return apijson.loads(self._call(f"reading ResourceClaim {namespace}/{name}", lambda: self._resource.read_namespaced_resource_claim(
            name, namespace, _preload_content=False, _request_timeout=self._timeout)).data)

    def record_event(self, namespace: str, pod: str, pod_uid: str, reason: str, message: str) -> None:
        """A Warning Event on the pod, so ``kubectl describe pod`` shows why qgpu acted on it."""
        self._create_event(namespace, {"kind": "Pod", "apiVersion": "v1", "namespace": namespace, "name": pod, "uid": pod_uid},
                           "Warning", reason, message, {"component": "qgpu-manager"}, f"pod {namespace}/{pod}")

    def set_node_condition(self, node: str, condition: Mapping[str, str]) -> None:
        """One condition of the Node's status, by strategic merge (conditions merge by type: the
        kubelet's stay as they are). The roles' admission policy lets the manager write only
        names.SHARES_ENFORCED_CONDITION there."""
        body = {"status": {"conditions": [dict(condition)]}}
        drain(self._call(f"setting condition {condition.get('type')} of node {node}", lambda: self._core.patch_node_status(
            node, body, _content_type=STRATEGIC_MERGE_PATCH, _preload_content=False, _request_timeout=self._timeout)))

    def record_node_event(self, node: str, event_type: str, reason: str, message: str) -> None:
        """An Event on the Node (in namespace default, as the kubelet's are), so ``kubectl describe
        node`` shows it."""
        self._create_event("default", node_reference(node), event_type, reason, message,
                           {"component": "qgpu-manager", "host": node}, f"node {node}")

    def _create_event(self, namespace: str, involved: Mapping[str, str], event_type: str, reason: str, message: str,
                      source: Mapping[str, str], what: str) -> None:
        body = event_body(namespace, involved, event_type, reason, message, source)
        drain(self._call(f"recording event {reason} on {what}", lambda: self._core.create_namespaced_event(
            namespace, body, _preload_content=False, _request_timeout=self._timeout)))


class KubeSlices:
    """The ResourceSlice calls of node/draslices.py, through ``source``'s client, timeouts and retries."""

    def __init__(self, source: KubePodSource) -> None:
        self._source = source
        self._resource = client.ResourceV1Api(source.api_client)
        self._core = client.CoreV1Api(source.api_client)
        self._timeout = source._timeout
        self._streams = OpenStreams()

    def node_uid(self, node: str) -> str:
        doc = apijson.loads(self._source._call(f"reading node {node}", lambda: self._core.read_node(
            node, _preload_content=False, _request_timeout=self._timeout)).data)
        return str(doc["metadata"]["uid"])

    def read_slice(self, name: str) -> dict[str, Any] | None:
        try:
            response = self._source._call(f"reading ResourceSlice {name}", lambda: self._resource.read_resource_slice(
                name, _preload_content=False, _request_timeout=self._timeout))
        except PodSourceError as exc:
            if isinstance(exc.__cause__, NotFound):
                return None
            raise
        return dict(apijson.loads(response.data))

    def create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return dict(apijson.loads(self._source._call(f"creating ResourceSlice {name}", lambda: self._resource.create_resource_slice(
            body, _preload_content=False, _request_timeout=self._timeout)).data))

    def replace_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(apijson.loads(self._source._call(f"updating ResourceSlice {name}", lambda: self._resource.replace_resource_slice(
            name, body, _preload_content=False, _request_timeout=self._timeout)).data))

    def watch_slice(self, name: str, resource_version: str, timeout_s: float, stop: threading.Event) -> str | None:
        """One watch of the slice by name from ``resource_version``: the first event's type, None when
        the apiserver ended the watch or ``close`` cut it."""
        response = self._source._call(f"watching ResourceSlice {name}", lambda: self._resource.list_resource_slice(
            field_selector=f"metadata.name={name}", watch=True, resource_version=resource_version,
            timeout_seconds=int(timeout_s), _preload_content=False, _request_timeout=(self._timeout[0], timeout_s + 30)))
        with self._streams.held(response):
            try:
                if stop.is_set():
                    return None
                for line in response:
                    if not line.strip():
                        continue
                    event = apijson.loads(line)
                    kind = str(event.get("type") or "")
                    if kind == "ERROR":  # 410 Gone: the version is too old; the caller reads again
                        return "EXPIRED"
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        return kind
                return None
            except Exception as exc:  # noqa: BLE001 - a cut stream (close, network) is one clear error
                if stop.is_set():
                    return None
                raise PodSourceError(f"watching ResourceSlice {name} at {self._source.server}: {described(exc)}",
                                     transient=True) from exc

    def close(self) -> None:
        """Cut the watches in progress (the manager is stopping)."""
        self._streams.close()
