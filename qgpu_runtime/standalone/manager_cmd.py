"""``qgpu manager serve --standalone``: the standalone host manager.

It enforces the host's isolation policy on the jobs ``qgpu run`` started, without Kubernetes or
systemd. qgpu_runtime/manager_cmd.py puts its options beside the node manager's in one parser and
chooses between the two.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from prometheus_client import CollectorRegistry

from qgpu_runtime.gpu.nvml_lib import NvmlUnavailable
from qgpu_runtime.isolation.mps import MpsError
from qgpu_runtime.isolation.policy import parse_policy
from qgpu_runtime.serving import JsonServer, metrics_server
from qgpu_runtime.standalone.config import MPS_MODES, load_config
from qgpu_runtime.standalone.dbfile import ManagerLock, claim, resolve
from qgpu_runtime.standalone.manager import StandaloneManager
from qgpu_runtime.standalone.run_cmd import DEFAULT_DB
from qgpu_runtime.standalone.store import Store, StoreError


def add_standalone_arguments(serve: argparse.ArgumentParser, with_backend: bool = True) -> None:
    """Options of the standalone manager (``with_backend`` False when the parser already has
    --gpu-backend/--simulated-gpus/--dbfile, as the node manager's does)."""
    serve.add_argument("--standalone", action="store_true", help="manage this host's `qgpu run` jobs (no Kubernetes)")
    serve.add_argument("--config", help="YAML settings: policy, placement, gpu_backend, simulated_gpus, mps, tick_s, memory_tolerance_mib")
    serve.add_argument("--policy", help="isolation policy: best-effort|be, fixed-share|fs, burst-share|bs (default best-effort)")
    serve.add_argument("--placement", help="card choice: binpack (default), spread, bestfit, frag")
    serve.add_argument("--mps", choices=MPS_MODES, help="use NVIDIA MPS for caps: off (default), auto, on")
    serve.add_argument("--tick", type=float, dest="tick_s", help="control period in seconds (default 0.05)")
    serve.add_argument("--memory-tolerance", type=int, dest="memory_tolerance_mib", help="MiB over quota tolerated before the watchdog acts")
    serve.add_argument("--simulated-usage", help="with --gpu-backend simulated: JSON file of what each job does (tests, demos)")
    serve.add_argument("--standalone-metrics-port", type=int, default=0, help="Prometheus port on 127.0.0.1 (0: off)")
    if with_backend:
        serve.add_argument("--dbfile", default=DEFAULT_DB, help=f"standalone state database (default {DEFAULT_DB})")
        serve.add_argument("--gpu-backend", choices=("nvml", "simulated"), help="nvml (default) or simulated, only on purpose")
        serve.add_argument("--simulated-gpus", metavar="SPEC", help="with --gpu-backend simulated, e.g. 2xT4-16G")
        serve.add_argument("--log-level", default="INFO")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _setup_problem(args: argparse.Namespace) -> str | None:
    """Flags checked before anything starts, or None."""
    if str(args.log_level).upper() not in LOG_LEVELS:
        return f"--log-level {args.log_level!r}: not a level: use one of {', '.join(LOG_LEVELS)}"
    port = args.standalone_metrics_port
    if not 0 <= port <= 65535:
        return f"--standalone-metrics-port {port}: must be a port 1..65535, or 0 for no metrics"
    return None


def serve_standalone(args: argparse.Namespace) -> int:
    problem = _setup_problem(args)
    if problem:
        print(f"qgpu manager serve: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("qgpu.standalone")
    overrides = {k: getattr(args, k, None) for k in ("policy", "placement", "mps", "tick_s", "memory_tolerance_mib", "gpu_backend", "simulated_gpus")}
    # The node manager's --nodename and --isolation-policy mean the same here (one command line
    # describes a host both ways); --policy is this manager's own spelling of the latter.
    overrides["node_name"] = getattr(args, "nodename", None)
    node_policy = getattr(args, "isolation_policy", None)
    overrides["policy"] = args.policy if args.policy is not None else node_policy
    lock: ManagerLock | None = None
    store: Store | None = None
    metrics: JsonServer | None = None
    try:
        if (
            node_policy is not None
            and args.policy is not None
            and parse_policy(args.policy, field="--policy") != parse_policy(node_policy, field="--isolation-policy")
        ):
            raise ValueError(f"--policy {args.policy!r} and --isolation-policy {node_policy!r} disagree: give one")
        config = load_config(args.config, overrides)
        dbfile = resolve(str(args.dbfile))  # one file from here on (dbfile.py)
        lock = claim(dbfile)
        store = Store(dbfile)
        registry = CollectorRegistry()
        manager = StandaloneManager(store, config, registry, args.simulated_usage)
        if args.standalone_metrics_port:
            # before start(): a busy port must not leave an MPS daemon or a new inventory behind
            metrics = _listen(args.standalone_metrics_port, registry)
        manager.start()
    except (ValueError, StoreError, NvmlUnavailable, MpsError) as err:
        log.error("%s", err)
        _close(metrics, store, lock)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        manager.serve(stop)
    finally:
        _close(metrics, store, lock)
    return 0


def _close(metrics: JsonServer | None, store: Store | None, lock: ManagerLock | None) -> None:
    if metrics is not None:
        metrics.stop()
    if store is not None:
        store.close()
    if lock is not None:
        lock.release()


def _listen(port: int, registry: CollectorRegistry) -> JsonServer:
    try:
        return metrics_server("127.0.0.1", port, registry)
    except OSError as err:
        raise ValueError(f"--standalone-metrics-port {port}: cannot listen on 127.0.0.1:{port}: {err.strerror or err}") from None
