"""`qgpu validate FILE…`: lint GPU requests in manifests offline, before they reach a cluster.

Reads YAML or JSON (several documents per file, ``-`` for stdin), finds the pod spec of a Pod or
of any workload with a pod template, and runs the same parser the webhook runs.

A manifest is untrusted input: a CI job may run this on whatever a pull request brings. So a
file that cannot be read or parsed (missing, a directory, no permission, not UTF-8, broken
YAML, too large, an alias bomb) is one line naming the file, never a traceback, and gets its own
exit status so a pipeline can tell "the manifests are wrong" from "the check did not run".
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import yaml

from qgpu_runtime.contract.cliflags import int_within, read_small_text
from qgpu_runtime.contract.inventory import MAX_CARDS, MAX_MEMORY_MIB
from qgpu_runtime.model.podshape import check_pod
from qgpu_runtime.model.requests import DEFAULT_LIMITS, CardLimits, RequestError, parse_pod

EXIT_VALID = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2  # argparse's own status for bad options
EXIT_UNREADABLE = 3

EXIT_CODES_HELP = f"""exit status:
  {EXIT_VALID}  every object is valid
  {EXIT_FINDINGS}  at least one GPU request breaks a rule (each is printed on stdout)
  {EXIT_USAGE}  bad command-line options
  {EXIT_UNREADABLE}  a file could not be read or parsed (one line on stderr per file; the other files are still checked)
"""

MAX_CARD_GIB = MAX_MEMORY_MIB // 1024
"""--max-card-memory and --gib-per-shared-pod: at most the 1 TiB card the node inventory keeps."""

MAX_FILE_BYTES = 64 * 1024 * 1024
"""Larger inputs are refused: no manifest is this big, and /dev/zero must not fill memory."""

MAX_EXPANDED_NODES = 1_000_000
"""YAML nodes a document may stand for once its aliases are expanded. Aliases cost nothing to
parse but every consumer walks them in full: nine aliases nested nine deep ("billion laughs") are
a few hundred bytes and 387 million nodes."""


class UnreadableInput(Exception):
    """A file that cannot be read or parsed; the message is the one line the user sees."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts the nodes each document expands to, aliases included, while
    composing it, and refuses recursive aliases; the count is taken before any object is built."""

    def compose_document(self) -> Any:
        self._expanded = 0
        self._sizes: dict[int, int] = {}
        return super().compose_document()

    def _count(self, nodes: int, mark: Any) -> None:
        self._expanded += nodes
        if self._expanded > MAX_EXPANDED_NODES:
            raise yaml.composer.ComposerError(
                None, None, f"aliases expand to more than {MAX_EXPANDED_NODES} nodes (an alias bomb?)", mark)

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None:
                if id(target) not in self._sizes:
                    raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} refers to a node that contains it", event.start_mark)
                self._count(self._sizes[id(target)], event.start_mark)
            return super().compose_node(parent, index)
        before = self._expanded
        self._count(1, event.start_mark)
        node = super().compose_node(parent, index)
        if event.anchor is not None:
            self._sizes[id(node)] = self._expanded - before
        return node


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


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def pod_of(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pod (metadata + spec) an object describes, or None for kinds without pods."""
    kind = obj.get("kind")
    if not isinstance(kind, str) or kind not in TEMPLATE_PATHS:
        return None
    node: Any = obj
    for key in TEMPLATE_PATHS[kind]:
        node = node.get(key) if isinstance(node, Mapping) else None
    if not isinstance(node, Mapping):
        return {}
    meta = node.get("metadata")
    if meta is None or isinstance(meta, Mapping):  # anything else is reported by the shape check
        outer = _mapping(obj.get("metadata"))
        meta = {"name": outer.get("name"), "namespace": outer.get("namespace"), **(meta or {})}
    return {"metadata": meta, "spec": node.get("spec") or {}}


def _objects(doc: Any) -> Iterator[Mapping[str, Any]]:
    if isinstance(doc, Mapping):
        kind = doc.get("kind")
        if isinstance(kind, str) and kind.endswith("List") and isinstance(doc.get("items"), list):
            for item in doc["items"]:
                yield from _objects(item)
        else:
            yield doc


def load_documents(text: str) -> list[Any]:
    """Every YAML/JSON document of ``text``, or :class:`UnreadableInput` with the reason."""
    try:
        return list(yaml.load_all(text, Loader=_BoundedLoader))  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise UnreadableInput(f"{where}: not valid YAML/JSON: {getattr(exc, 'problem', None) or exc}") from exc
    except RecursionError as exc:
        raise UnreadableInput(": not valid YAML/JSON: nested too deeply") from exc
    except ValueError as exc:  # a scalar its resolver cannot build, e.g. the date 2024-13-45
        raise UnreadableInput(f": not valid YAML/JSON: {exc}") from exc


def _yaml_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), type(value).__name__)


class _ShapeProblem(ValueError):
    pass


def validate_text(text: str, source: str, limits: CardLimits = DEFAULT_LIMITS) -> tuple[list[Finding], int]:
    """Findings for every object in ``text``, and how many pod-bearing objects were checked.

    Raises :class:`UnreadableInput` for input that is not YAML/JSON.
    """
    findings: list[Finding] = []
    checked = 0
    for number, doc in enumerate(load_documents(text), 1):
        if doc is not None and not isinstance(doc, Mapping):  # an empty document (a stray ---) is nothing
            raise UnreadableInput(f": document {number} is a {_yaml_type(doc)}, not a Kubernetes object "
                                  "(a mapping with apiVersion and kind)")
        for obj in _objects(doc):
            pod = pod_of(obj)
            if pod is None:
                continue
            checked += 1
            kind = str(obj.get("kind"))
            name = str(_mapping(obj.get("metadata")).get("name") or "<unnamed>")
            if not pod.get("spec"):
                findings.append(Finding(source, kind, name, "no pod spec found where the kind keeps it"))
                continue
            try:
                parse_pod(check_pod(pod, "pod", _ShapeProblem, integer_quantities=True), limits)
            except _ShapeProblem as exc:
                findings.append(Finding(source, kind, name, str(exc)))
            except RequestError as exc:
                findings.extend(Finding(source, kind, name, str(p)) for p in exc.problems)
    return findings, checked


def read_source(path: str) -> str:
    """The text of ``path`` (``-``: stdin), or :class:`UnreadableInput` with the reason."""
    try:
        return read_small_text(sys.stdin.buffer if path == "-" else path, MAX_FILE_BYTES, "", "a manifest")
    except ValueError as exc:
        raise UnreadableInput(str(exc)) from exc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXIT_CODES_HELP
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML or JSON manifests; - reads stdin")
    parser.add_argument("--gib-per-shared-pod", type=int_within(1, MAX_CARD_GIB, "GiB"), default=DEFAULT_LIMITS.gib_per_shared_pod,
                        help=f"card memory per shared pod slot (GiB, 1..{MAX_CARD_GIB}); default %(default)s")
    parser.add_argument("--max-card-memory", type=int_within(1, MAX_CARD_GIB, "GiB, a card of 1 GiB to 1 TiB"),
                        default=DEFAULT_LIMITS.max_card_memory_mib // 1024,
                        help=f"largest card in the fleet (GiB, 1..{MAX_CARD_GIB}): larger requests can never fit; default %(default)s")
    parser.add_argument("--max-cards-per-node", type=int_within(1, MAX_CARDS, "cards of one node"),
                        default=DEFAULT_LIMITS.max_cards_per_node,
                        help=f"most cards on any node (1..{MAX_CARDS}); default %(default)s")


def run(args: argparse.Namespace) -> int:
    try:
        limits = CardLimits(gib_per_shared_pod=args.gib_per_shared_pod, max_card_memory_mib=args.max_card_memory * 1024,
                            max_cards_per_node=args.max_cards_per_node)
    except ValueError as exc:
        print(f"qgpu validate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    total_findings = 0
    total_checked = 0
    unreadable = 0
    for path in args.files:
        source = "<stdin>" if path == "-" else path
        try:
            findings, checked = validate_text(read_source(path), source, limits)
        except UnreadableInput as exc:
            print(f"qgpu validate: {source}{exc}", file=sys.stderr)
            unreadable += 1
            continue
        for finding in findings:
            print(finding)
        total_findings += len(findings)
        total_checked += checked
    status = "error" if total_findings == 1 else "errors"
    skipped = f", {unreadable} file(s) unreadable" if unreadable else ""
    print(f"{total_checked} object(s) checked, {total_findings} {status}{skipped}", file=sys.stderr)
    if unreadable:
        return EXIT_UNREADABLE
    return EXIT_FINDINGS if total_findings else EXIT_VALID
