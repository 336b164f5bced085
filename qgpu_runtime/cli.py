"""The `qgpu` command: one entry point, a subcommand module per job.

Subcommand modules are imported only when chosen, so `qgpu validate` does not pay for gRPC or
the Kubernetes client.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from qgpu_runtime import __version__

# command name -> module exposing add_arguments(parser) and run(args) -> int
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("qgpu_runtime.validate_cmd", "lint GPU requests in manifests offline"),
    "simulate": ("qgpu_runtime.sim.cli", "replay a GPU cluster trace through the placement engine"),
    "run": ("qgpu_runtime.standalone.run_cmd", "run a command on a share of a local GPU (standalone host)"),
    "manager": ("qgpu_runtime.manager_cmd", "run the node manager (device plugin, store, metrics), or with --standalone a host's qgpu run jobs"),
    "status": ("qgpu_runtime.status_cmd", "show GPU allocations per node and card"),
    "extender": ("qgpu_runtime.extender.cli", "kube-scheduler extender: filter, prioritize and bind GPU pods"),
    "webhook": ("qgpu_runtime.webhook.cli", "admission webhook: validate and complete GPU requests"),
    "scheduler-wiring": ("qgpu_runtime.wiring.cli", "on a master: keep kube-scheduler wired to the extender across upgrades"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qgpu", description="GPU sharing for Kubernetes and single hosts")
    parser.add_argument("--version", action="version", version=f"qgpu {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not args or args[0] not in COMMANDS:
        parser.parse_args(args)  # prints usage / --version / an error naming the bad command
        return 2
    name, rest = args[0], args[1:]
    module = importlib.import_module(COMMANDS[name][0])
    sub = argparse.ArgumentParser(prog=f"qgpu {name}", description=COMMANDS[name][1])
    module.add_arguments(sub)
    try:
        return int(module.run(sub.parse_args(rest)) or 0)
    except BrokenPipeError:
        # The reader left (`qgpu status | head -1`): no traceback, and stdout pointed at /dev/null so
        # the interpreter's own flush at exit does not fail a second time. 141 is a shell's status
        # for a process SIGPIPE ended, which is what a reader that stops reading expects.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
