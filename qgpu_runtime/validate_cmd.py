"""`qgpu validate FILE…`: lint GPU requests in manifests offline, before they reach a cluster.

Reads YAML or JSON (several documents per file, ``-`` for stdin), finds the pod spec of a Pod or
of any workload with a pod template, and runs the same parser the webhook runs. Exit 0 when every
object is valid, 1 when any error was found, 2 when a file cannot be read or parsed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import yaml

from qgpu_runtime.model.requests import DEFAULT_LIMITS, CardLimits, RequestError, parse_pod

# kind -> path to the pod template inside the object
TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": (),
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "ReplicationController": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
    "PodTemplate": ("template",),
}


@dataclass(frozen=True)
class Finding:
    source: str
    kind: str
    name: str
    message: str

    def __str__(self) -> str:
        return f"{self.source}: {self.kind}/{self.name}: {self.message}"


def pod_of(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pod (metadata + spec) an object describes, or None for kinds without pods."""
    kind = obj.get("kind")
    if kind not in TEMPLATE_PATHS:
        return None
    node: Any = obj
    for key in TEMPLATE_PATHS[kind]:
        node = node.get(key) if isinstance(node, Mapping) else None
    if not isinstance(node, Mapping):
        return {}
    meta = dict(node.get("metadata") or {})
    outer = obj.get("metadata") or {}
    meta.setdefault("name", outer.get("name"))
    meta.setdefault("namespace", outer.get("namespace"))
    return {"metadata": meta, "spec": node.get("spec") or {}}


def _objects(doc: Any) -> Iterator[Mapping[str, Any]]:
    if isinstance(doc, Mapping):
        if doc.get("kind") == "List" or (doc.get("kind", "").endswith("List") and "items" in doc):
            for item in doc.get("items") or []:
                yield from _objects(item)
        else:
            yield doc


def validate_text(text: str, source: str, limits: CardLimits = DEFAULT_LIMITS) -> tuple[list[Finding], int]:
    """Findings for every object in ``text``, and how many pod-bearing objects were checked.

    Raises yaml.YAMLError for unparsable input.
    """
    findings: list[Finding] = []
    checked = 0
    for doc in yaml.safe_load_all(text):
        for obj in _objects(doc):
            pod = pod_of(obj)
            if pod is None:
                continue
            checked += 1
            kind = str(obj.get("kind"))
            name = str((obj.get("metadata") or {}).get("name") or "<unnamed>")
            if not pod.get("spec"):
                findings.append(Finding(source, kind, name, "no pod spec found where the kind keeps it"))
                continue
            try:
                parse_pod(pod, limits)
            except RequestError as exc:
                findings.extend(Finding(source, kind, name, str(p)) for p in exc.problems)
    return findings, checked


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML or JSON manifests; - reads stdin")
    parser.add_argument("--gib-per-shared-pod", type=int, default=DEFAULT_LIMITS.gib_per_shared_pod,
                        help="card memory per shared pod slot (GiB); default %(default)s")
    parser.add_argument("--max-card-memory", type=int, default=DEFAULT_LIMITS.max_card_memory_mib // 1024,
                        help="largest card in the fleet (GiB): larger requests can never fit; default %(default)s")
    parser.add_argument("--max-cards-per-node", type=int, default=DEFAULT_LIMITS.max_cards_per_node,
                        help="most cards on any node; default %(default)s")


def run(args: argparse.Namespace) -> int:
    try:
        limits = CardLimits(gib_per_shared_pod=args.gib_per_shared_pod, max_card_memory_mib=args.max_card_memory * 1024,
                            max_cards_per_node=args.max_cards_per_node)
    except ValueError as exc:
        print(f"qgpu validate: {exc}", file=sys.stderr)
        return 2
    total_findings = 0
    total_checked = 0
    for path in args.files:
        source = "<stdin>" if path == "-" else path
        try:
            text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
        except OSError as exc:
            print(f"qgpu validate: {source}: cannot read: {exc.strerror}", file=sys.stderr)
            return 2
        try:
            findings, checked = validate_text(text, source, limits)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            print(f"qgpu validate: {source}{where}: not valid YAML/JSON: {getattr(exc, 'problem', exc)}", file=sys.stderr)
            return 2
        for finding in findings:
            print(finding)
        total_findings += len(findings)
        total_checked += checked
    status = "error" if total_findings == 1 else "errors"
    print(f"{total_checked} object(s) checked, {total_findings} {status}", file=sys.stderr)
    return 1 if total_findings else 0
