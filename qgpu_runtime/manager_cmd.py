"""``qgpu manager serve [--standalone] …``: one command, two managers, chosen here and only here.

Without ``--standalone`` it is the cluster node manager (qgpu_runtime/node/cli.py); with it, the
standalone host manager (qgpu_runtime/standalone/manager_cmd.py). Both sets of options live in one
``serve`` parser, so ``--help`` shows them together; the node manager's ``--dbfile``,
``--gpu-backend``, ``--simulated-gpus`` and ``--log-level`` keep their meaning in both modes.
node/ and standalone/ never import each other: this module, at the command layer, knows both.
"""

from __future__ import annotations

import argparse
import sys

from qgpu_runtime.node import cli as node_cli
from qgpu_runtime.standalone import manager_cmd as standalone_cli

# The node manager's options that the standalone manager honours too; every other option of one
# manager is refused by the other (given, it would be silently ignored).
SHARED = frozenset({"--nodename", "--dbfile", "--gpu-backend", "--simulated-gpus", "--log-level", "--isolation-policy"})


_GIVEN = "_given"  # the namespace's set of the dests whose option was on the command line
_MARKING: dict[type, type] = {}


def _marking(cls: type) -> type:
    """``cls`` that also records, when argparse calls it (only for an option on the command line,
    never for a default), that its option was given: a value equal to the default counts too."""
    if cls not in _MARKING:
        def __call__(self, parser, namespace, values, option_string=None):  # noqa: N807
            setattr(namespace, _GIVEN, getattr(namespace, _GIVEN, frozenset()) | {self.dest})
            return cls.__call__(self, parser, namespace, values, option_string)
        _MARKING[cls] = type(f"Marking{cls.__name__}", (cls,), {"__call__": __call__})
    return _MARKING[cls]


class _Recorder:
    """The parser, recording the options added through it and marking them when given."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._parser = parser
        self.actions: list[argparse.Action] = []

    def add_argument(self, *names: str, **kwargs) -> argparse.Action:
        action = self._parser.add_argument(*names, **kwargs)
        action.__class__ = _marking(type(action))
        self.actions.append(action)
        return action


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = sub.add_parser("serve", help="run the node manager")
    node, standalone = _Recorder(serve), _Recorder(serve)
    node_cli.add_serve_arguments(node)
    standalone_cli.add_standalone_arguments(standalone, with_backend=False)
    serve.set_defaults(
        _node_only=[a for a in node.actions if not SHARED.intersection(a.option_strings)],
        _standalone_only=[a for a in standalone.actions if a.dest != "standalone"],
    )


def foreign_options(args: argparse.Namespace) -> list[str]:
    """The options given that belong to the other manager than the one --standalone chose, whatever
    their value: `--standalone --metrics-port 5678` (the node manager's default) is refused too."""
    others = getattr(args, "_node_only" if args.standalone else "_standalone_only", [])
    given = getattr(args, _GIVEN, frozenset())
    return [a.option_strings[0] for a in others if a.dest in given]


def run(args: argparse.Namespace) -> int:
    foreign = foreign_options(args)
    if foreign:
        mode, other = ("--standalone", "the cluster node manager") if args.standalone else ("without --standalone", "the standalone manager")
        print(
            f"qgpu manager serve {mode}: {', '.join(foreign)} belong(s) to {other} and would be ignored here; "
            f"drop them (shared by both: {', '.join(sorted(SHARED))})",
            file=sys.stderr,
        )
        return 2
    if args.standalone:
        return standalone_cli.serve_standalone(args)
    return node_cli.run(args)
