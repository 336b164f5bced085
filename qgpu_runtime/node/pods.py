"""Where the node manager reads pods and writes annotations: the Kubernetes API, or a file.

The manager depends only on :class:`PodSource`. ``KubePodSource`` (node/kube_client.py) talks to
the apiserver; ``FilePodSource`` reads a JSON list of pod objects from a file — for demos and
for tests of the manager as a real process on hosts without an apiserver. Both hand out pods as
API-JSON dicts (camelCase keys), the shape ``parse_pod`` and the matcher read.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Mapping, Protocol

from qgpu_runtime.contract.cliflags import read_small_text
from qgpu_runtime.kube.reader import ApiCallError


class PodSourceError(ApiCallError):
    """Pods could not be read or written; the message names the call, the source and the reason.

    ``transient`` says whether trying again later can help (apiserver down or overloaded) or not
    (forbidden, not found, a bad kubeconfig): the manager waits out the first, exits on the second.
    """


class PodSource(Protocol):
    def pods_on_node(self, node: str) -> list[dict[str, Any]]: ...

    def patch_pod_annotations(self, namespace: str, name: str, values: Mapping[str, str]) -> None: ...

    def patch_node(self, node: str, labels: Mapping[str, str], annotations: Mapping[str, str]) -> None: ...

    def patch_node_capacity(self, node: str, capacity: Mapping[str, str]) -> None: ...

    def node_labels(self, node: str) -> dict[str, str]: ...

    def record_event(self, namespace: str, pod: str, pod_uid: str, reason: str, message: str) -> None: ...

    def set_node_condition(self, node: str, condition: Mapping[str, str]) -> None:
        """Add or replace the condition of ``condition["type"]`` in the Node's status, others kept."""

    def record_node_event(self, node: str, event_type: str, reason: str, message: str) -> None: ...


MAX_PODS_FILE_BYTES = 64 * 1024 * 1024
"""A node runs at most a few hundred pods: a larger file is not a pod list (and /dev/zero never ends)."""


class FilePodSource:
    """Pods from a JSON file (``{"items": [pod, ...]}`` or a bare list), re-read when it changes.

    Patches are applied to the file atomically (write to a temp file, rename), so another process
    — a test, a demo script — sees them. The node object lives in ``<file>.node.json`` (patches
    merge into it; its labels are what ``node_labels`` reads); events are appended, one JSON object
    a line, to ``<file>.events.jsonl``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._items: list[dict[str, Any]] = []

    def _load(self) -> list[dict[str, Any]]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._items = self._parse()
            self._stamp = stamp
        return self._items

    def _parse(self) -> list[dict[str, Any]]:
        """The file's pods; ValueError naming the file and the rule when it is not a pod list."""
        where = f"--pods-file {self.path}"
        text = read_small_text(self.path, MAX_PODS_FILE_BYTES, where, "a pod list")
        try:
            data = json.loads(text or "[]")
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        items = data.get("items", []) if isinstance(data, dict) else data
        if not isinstance(items, list) or not all(isinstance(p, dict) for p in items):
            raise ValueError(f"{where}: must be a JSON list of pod objects, or an object whose 'items' is one")
        return list(items)

    def pods_on_node(self, node: str) -> list[dict[str, Any]]:
        with self._lock:
            return [p for p in self._load() if (p.get("spec") or {}).get("nodeName") == node]

    def _write(self, items: list[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(self.path.suffix + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"items": items}))
        os.replace(tmp, self.path)
        self._stamp = None

    def patch_pod_annotations(self, namespace: str, name: str, values: Mapping[str, str]) -> None:
        with self._lock:
            items = self._load()
            for pod in items:
                meta = pod.setdefault("metadata", {})
                if meta.get("namespace", "default") == namespace and meta.get("name") == name:
                    meta.setdefault("annotations", {}).update(values)
                    self._write(items)
                    return
            raise LookupError(f"pod {namespace}/{name} is not in {self.path}")

    def _node_file(self) -> Path:
        return self.path.with_suffix(".node.json")

    def _node(self, node: str) -> dict[str, Any]:
        try:
            data = json.loads(self._node_file().read_text())
        except FileNotFoundError:
            return {"metadata": {"name": node}}
        return data if isinstance(data, dict) else {"metadata": {"name": node}}

    def patch_node(self, node: str, labels: Mapping[str, str], annotations: Mapping[str, str]) -> None:
        with self._lock:
            obj = self._node(node)
            meta = obj.setdefault("metadata", {})
            meta.setdefault("labels", {}).update(labels)
            meta.setdefault("annotations", {}).update(annotations)
            self._write_node(obj)

    def _write_node(self, obj: dict[str, Any]) -> None:
        target = self._node_file()
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, target)

    def patch_node_capacity(self, node: str, capacity: Mapping[str, str]) -> None:
        with self._lock:
            obj = self._node(node)
            status = obj.setdefault("status", {})
            for side in ("capacity", "allocatable"):
                status.setdefault(side, {}).update(capacity)
            self._write_node(obj)

    def node_labels(self, node: str) -> dict[str, str]:
        with self._lock:
            return dict((self._node(node).get("metadata") or {}).get("labels") or {})

    def record_event(self, namespace: str, pod: str, pod_uid: str, reason: str, message: str) -> None:
        self._append_event({"namespace": namespace, "pod": pod, "uid": pod_uid, "reason": reason, "message": message})

    def set_node_condition(self, node: str, condition: Mapping[str, str]) -> None:
        with self._lock:
            obj = self._node(node)
            status = obj.setdefault("status", {})
            status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != condition["type"]]
            status["conditions"].append(dict(condition))
            self._write_node(obj)

    def record_node_event(self, node: str, event_type: str, reason: str, message: str) -> None:
        self._append_event({"node": node, "type": event_type, "reason": reason, "message": message})

    def _append_event(self, event: Mapping[str, str]) -> None:
        with self._lock, open(self.path.with_suffix(".events.jsonl"), "a") as f:
            f.write(json.dumps(event) + "\n")
