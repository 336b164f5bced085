"""The JSON types of the Pod fields qgpu reads, checked once where a pod arrives over the wire.

The extender and the webhook receive pods as JSON from kube-scheduler and kube-apiserver, which
always send the types of the core/v1 schema. A body that does not (``"containers": 5``, a number
where a quantity string belongs) is a client's mistake and gets a 400 naming the field, instead
of an AttributeError deep in the parser and a 500. Checking here, at the decoding edge, keeps
the parser, the cache and the mutation free of defensive type tests.

``null`` stands for an absent field, as it does for Go's decoder. Quantities must be strings on
the wire, where the apiserver always serialises them so; a hand-written manifest may also give
integers (``nvidia.com/gpu: 1``), as kubectl accepts.
"""

from __future__ import annotations

from typing import Any, Callable

from qgpu_runtime.model.quantity import show_value

ShapeError = Callable[[str], Exception]


class _Checker:
    def __init__(self, where: str, error: ShapeError):
        self.where = where
        self.error = error

    def fail(self, path: str, value: Any, rule: str) -> Exception:
        return self.error(f"{self.where}{path}={show_value(value)}: {rule}")

    def object(self, value: Any, path: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, value, "must be an object")
        for key in value:
            if not isinstance(key, str):  # JSON keys always are; YAML's need not be
                raise self.fail(f"{path}[{key!r}]", value[key], "keys must be strings")
        return value

    def string(self, value: Any, path: str) -> None:
        if value is not None and not isinstance(value, str):
            raise self.fail(path, value, "must be a string")

    def strings(self, mapping: dict[str, Any], path: str, what: str, also: tuple[type, ...] = ()) -> None:
        for key, value in mapping.items():
            if not isinstance(value, (str, *also)) or isinstance(value, bool):
                raise self.fail(f"{path}[{key!r}]", value, f"must be a string ({what})")

    def objects(self, value: Any, path: str) -> list[dict[str, Any]]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(path, value, "must be a list of objects")
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise self.fail(f"{path}[{i}]", item, "must be an object")
        return value


def check_pod(pod: Any, where: str, error: ShapeError, integer_quantities: bool = False) -> dict[str, Any]:
    """``pod`` itself if every field qgpu reads has its core/v1 JSON type; else ``error(message)``
    is raised, the message naming the field (``where`` + path), its value and the rule.
    ``integer_quantities`` lets a manifest write quantities as integers."""
    check = _Checker(where, error)
    quantity_types: tuple[type, ...] = (int,) if integer_quantities else ()
    if not isinstance(pod, dict):
        raise check.fail("", pod, "must be a Pod object")
    meta = check.object(pod.get("metadata"), ".metadata")
    for name in ("name", "namespace", "uid", "generateName"):
        check.string(meta.get(name), f".metadata.{name}")
    for name in ("annotations", "labels"):
        check.strings(check.object(meta.get(name), f".metadata.{name}"), f".metadata.{name}", "annotation and label values")
    spec = check.object(pod.get("spec"), ".spec")
    for name in ("nodeName", "schedulerName"):
        check.string(spec.get(name), f".spec.{name}")
    check.objects(spec.get("tolerations"), ".spec.tolerations")
    for section in ("containers", "initContainers"):
        for i, container in enumerate(check.objects(spec.get(section), f".spec.{section}")):
            path = f".spec.{section}[{i}]"
            check.string(container.get("name"), f"{path}.name")
            resources = check.object(container.get("resources"), f"{path}.resources")
            for side in ("limits", "requests"):
                values = check.object(resources.get(side), f"{path}.resources.{side}")
                check.strings(values, f"{path}.resources.{side}", "a quantity", quantity_types)
    status = check.object(pod.get("status"), ".status")
    check.string(status.get("phase"), ".status.phase")
    return pod
