"""``qgpu scheduler-wiring``: check or restore kube-scheduler's wiring to the qgpu extender on a master.

  qgpu scheduler-wiring check --state /etc/kubernetes/qgpu/state.json   once; exit 0 wired, 1 re-wired, 2 failed
  qgpu scheduler-wiring watch --state ... [--kubeconfig F]              the systemd service: poll and re-wire

The state file is the kube_scheduler_extender role's record of what it applied (manifest path,
config file and format, version, TLS checksums, node name); the role installs the service with it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import yaml

from qgpu_runtime.kube.reader import ApiCallError
from qgpu_runtime.wiring import formats
from qgpu_runtime.wiring.heal import ManifestChanged, Reporter, StateError, Watcher, heal, log, read_state

# bounds on --interval: a faster poll costs a master CPU for nothing, a slower one leaves GPU pods
# scheduled without qgpu for longer after an upgrade
MIN_INTERVAL, MAX_INTERVAL = 0.2, 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in (("check", "look once: re-wire if needed (exit 0 wired, 1 re-wired now, 2 cannot)"),
                       ("watch", "poll the manifest and re-wire it whenever an upgrade rewrites it (the systemd service)")):
        action = sub.add_parser(name, help=text)
        action.add_argument("--state", required=True, type=Path,
                            help="the role's state file (kube_scheduler_extender_config_dir/state.json on the master)")
        action.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
        if name == "watch":
            action.add_argument("--interval", type=float, default=2.0,
                                help=f"seconds between looks at the manifest ({MIN_INTERVAL}-{MAX_INTERVAL}, default 2)")
            action.add_argument("--kubeconfig", default=None,
                                help="credentials that may create Events in namespace default (the role writes one for "
                                     "the qgpu-scheduler-wiring service account); without it the watcher only logs")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.action == "check":
        for attempt in range(3):  # a manifest rewritten while it was wired (kubeadm) is read again
            try:
                outcome = heal(args.state)
                break
            except ManifestChanged as exc:
                if attempt == 2:
                    print(f"qgpu scheduler-wiring: {exc} (three times in a row: run it again once the manifest "
                          "stops changing)", file=sys.stderr)
                    return 2
            except (StateError, formats.WiringError, OSError, ValueError, yaml.YAMLError) as exc:
                print(f"qgpu scheduler-wiring: {exc}", file=sys.stderr)
                return 2
        print(outcome.what)
        return 1 if outcome.changed else 0
    if not MIN_INTERVAL <= args.interval <= MAX_INTERVAL:
        print(f"qgpu scheduler-wiring: --interval {args.interval}: must be between {MIN_INTERVAL} and {MAX_INTERVAL} seconds",
              file=sys.stderr)
        return 2
    try:
        node = str(read_state(args.state)["node"])
    except StateError as exc:
        print(f"qgpu scheduler-wiring: {exc}", file=sys.stderr)
        return 2
    try:
        report = _reporter(args.kubeconfig, node)
    except ApiCallError as exc:
        print(f"qgpu scheduler-wiring: --kubeconfig {args.kubeconfig}: {exc}", file=sys.stderr)
        return 2
    watcher = Watcher(args.state, report)
    log.info("watching the kube-scheduler manifest named in %s every %.1f s (node %s)", args.state, args.interval, node)
    while True:
        watcher.tick()
        time.sleep(args.interval)


def _reporter(kubeconfig: str | None, node: str) -> Reporter:
    if not kubeconfig:
        return lambda event_type, reason, message: None
    from qgpu_runtime.kube.events import NodeEvents

    events = NodeEvents(kubeconfig, node, "qgpu-scheduler-wiring")

    def report(event_type: str, reason: str, message: str) -> None:
        try:
            events.post(event_type, reason, message)
        except ApiCallError as exc:  # the wiring is what matters; the Event is the news of it
            log.warning("could not record the %s Event on node %s: %s", reason, node, exc)

    return report
