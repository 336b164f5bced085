"""``qgpu manager serve [--standalone] …``: one command, two managers, chosen here and only here.

Without ``--standalone`` it is the cluster node manager (qgpu_runtime/node/cli.py); with it, the
standalone host manager (qgpu_runtime/standalone/manager_cmd.py). Both sets of options live in one
``serve`` parser, so ``--help`` shows them together; the node manager's ``--dbfile``,
``--gpu-backend``, ``--simulated-gpus`` and ``--log-level`` keep their meaning in both modes.
node/ and standalone/ never import each other: this module, at the command layer, knows both.
"""

from __future__ import annotations

import argparse

from qgpu_runtime.node import cli as node_cli
from qgpu_runtime.standalone import manager_cmd as standalone_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = sub.add_parser("serve", help="run the node manager")
    node_cli.add_serve_arguments(serve)
    standalone_cli.add_standalone_arguments(serve, with_backend=False)


def run(args: argparse.Namespace) -> int:
    if args.standalone:
        return standalone_cli.serve_standalone(args)
    return node_cli.run(args)
