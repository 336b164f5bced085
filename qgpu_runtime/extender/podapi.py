"""The binder's reads and writes of pods at the apiserver.

Read a pod (transient errors retried with backoff), list a T9k group's live pods, or learn that it does not exist (the trust
check's fallback, extender/trust.py); create the Binding that carries the allocation record (a 409
means the pod is bound already: :class:`~.bindresult.AlreadyBound` with the pod as it is now);
remove an unbound pod's record only while it is still exactly the one the expiry loop saw.
Every answer the extender does not need is still read to the end (``kube.client.drain``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from kubernetes import client

from qgpu_runtime.contract.names import ALLOCATION_SIGNATURE
from qgpu_runtime.contract.record import ALLOCATION, BIND_TIME
from qgpu_runtime.extender.bindresult import AlreadyBound
from qgpu_runtime.kube.client import drain, raw_json
from qgpu_runtime.kube.errors import ApiError, Conflict, NotFound, call
from qgpu_runtime.kube.errors import brief as short
from qgpu_runtime.kube.hotcalls import HotCalls
from qgpu_runtime.kube.paging import pages
from qgpu_runtime.kube.podslim import kept
from qgpu_runtime.kube.retry import is_transient, with_backoff


def _escape(annotation: str) -> str:
    return annotation.replace("~", "~0").replace("/", "~1")


class PodApi:
    """Pod reads, the Binding and the record's removal, each retried ``attempts`` times."""

    def __init__(self, api: client.CoreV1Api, timeout: tuple[float, float], attempts: int) -> None:
        self.api = api
        self.hot = HotCalls(api.api_client)  # the Binding, once per pod: the thin client (kube/hotcalls.py)
        self.timeout = timeout
        self.attempts = attempts

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return raw_json(with_backoff(
            lambda: call(self.api.read_namespaced_pod, name, namespace, _preload_content=False, _request_timeout=self.timeout),
            attempts=self.attempts))

    def list_live(self, namespace: str, label_selector: str, limit: int,
                  skip: Callable[[Mapping[str, Any]], bool] | None = None) -> tuple[list[dict[str, Any]], bool]:
        """The live (neither Succeeded nor Failed) pods of ``namespace`` matching ``label_selector``,
        at most ``limit`` of them as :func:`~qgpu_runtime.kube.podslim.kept` leaves them, and whether
        there are more. Read a page at a time under kube/paging.py's byte cap: a group's members are
        its tenant's pods, each up to etcd's object limit, and were decoded in one answer.
        ``skip``: pods left out and not counted towards ``limit``, judged as the apiserver has them."""
        listed: list[dict[str, Any]] = []

        def fetch(page_limit: int, token: str | None) -> Any:
            return with_backoff(lambda: call(
                self.api.list_namespaced_pod, namespace, label_selector=label_selector,
                field_selector="status.phase!=Succeeded,status.phase!=Failed", limit=min(page_limit, limit + 1 - len(listed)),
                _continue=token, _preload_content=False, _request_timeout=self.timeout), attempts=self.attempts)

        for page in pages(fetch):
            listed.extend(kept(p) for p in page if skip is None or not skip(p))
            if len(listed) > limit:
                return listed[:limit], True
        return listed, False

    def read_pod_once(self, namespace: str, name: str) -> dict[str, Any] | None:
        """One GET of the pod, None if it does not exist; any other failure raises (no retries:
        the caller has spent its own on the call whose outcome this asks)."""
        try:
            return raw_json(call(self.api.read_namespaced_pod, name, namespace, _preload_content=False,
                                 _request_timeout=self.timeout))
        except NotFound:
            return None

    def read_pod_if_exists(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod from the apiserver, None if it does not exist (the trust check's fallback)."""
        from qgpu_runtime.extender.trust import PodUnavailable, UntrustedPod

        try:
            return self.read_pod(namespace, name)
        except NotFound:
            return None
        except ApiError as exc:
            error = PodUnavailable if is_transient(exc) else UntrustedPod
            raise error(f"pod {namespace}/{name}: cannot read it from the apiserver ({short(exc)})") from exc
        except Exception as exc:
            if not is_transient(exc):
                raise
            raise PodUnavailable(f"pod {namespace}/{name}: the apiserver cannot be reached to read it "
                                 f"({short(exc)}); retry when it answers") from exc

    def create_binding(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if uid:
            metadata["uid"] = uid  # precondition: a replaced pod of the same name is not bound
        if annotations:
            metadata["annotations"] = annotations  # copied onto the pod with spec.nodeName, atomically
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": metadata,
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}

        def attempt() -> None:
            try:
                call(self.hot.create_binding, namespace, name, body, self.timeout)
            except Conflict as exc:
                # Bound already: an earlier attempt of ours (whose answer was lost), or someone else.
                raise AlreadyBound(self.read_pod(namespace, name)) from exc

        with_backoff(attempt, attempts=self.attempts)

    def remove_record(self, namespace: str, name: str, raw_record: str, uid: str = "") -> None:
        """Delete an unbound pod's record only if it is still exactly ``raw_record`` (JSON-patch test).

        qgpu's own binds never leave such records; they come from interrupted writers of older
        versions or other tools, and are cleaned up by the expiry loop.
        """
        pod = self.read_pod(namespace, name)
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        if annotations.get(ALLOCATION) != raw_record or (uid and meta.get("uid") != uid):
            return
        if (pod.get("spec") or {}).get("nodeName"):
            return  # bound after all: the record is live
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": f"/metadata/annotations/{_escape(ALLOCATION)}", "value": raw_record},
            {"op": "remove", "path": f"/metadata/annotations/{_escape(ALLOCATION)}"},
        ]
        for name_ in (BIND_TIME, ALLOCATION_SIGNATURE):
            if name_ in annotations:
                ops.append({"op": "remove", "path": f"/metadata/annotations/{_escape(name_)}"})
        with_backoff(lambda: drain(call(
            self.api.patch_namespaced_pod, name, namespace, ops, _content_type="application/json-patch+json",
            _preload_content=False, _request_timeout=self.timeout)), attempts=self.attempts)
