"""``qgpu manager serve``: run the node manager (device plugins, store, metrics) until SIGTERM."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from qgpu_runtime.contract.cliflags import address_problem, log_level_problem, port_problem, subdomain_problem
from qgpu_runtime.contract.dra import UNHEALTHY_EFFECTS
from qgpu_runtime.contract.largestcard import add_largest_card_argument, card_limits
from qgpu_runtime.node.deviceplugin.resources import CATALOG, DEFAULT_RESOURCES

if TYPE_CHECKING:
    from qgpu_runtime.contract.signature import RecordVerifier
    from qgpu_runtime.node.manager import NodeManager
    from qgpu_runtime.serving import JsonServer


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The node manager's options of ``qgpu manager serve`` (qgpu_runtime/manager_cmd.py adds the
    standalone manager's beside them)."""
    serve.add_argument("--nodename", default=os.environ.get("NODE_NAME"),
                       help="this node's name (default: $NODE_NAME)")
    serve.add_argument("--dbfile", type=Path, default=Path("/var/lib/qgpu/meta.db"), help="allocation store (SQLite)")
    serve.add_argument("--gpu-backend", choices=("nvml", "simulated"), default="nvml",
                       help="nvml on GPU hosts; simulated only on purpose (never a fallback)")
    serve.add_argument("--simulated-gpus", metavar="SPEC|FILE",
                       help="with --gpu-backend simulated: e.g. 2xT4-16G,1xA100-80G, or a YAML/JSON config file")
    serve.add_argument("--resources", default=",".join(DEFAULT_RESOURCES),
                       help=f"comma-separated resources to serve; known: {', '.join(CATALOG)}")
    serve.add_argument("--device-plugin-dir", type=Path, default=Path("/var/lib/kubelet/device-plugins"))
    serve.add_argument("--pod-resources-socket", type=Path, default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"))
    serve.add_argument("--state-dir", type=Path, default=Path("/var/lib/qgpu"),
                       help="host folder for per-container quota files mounted at /etc/qgpu")
    serve.add_argument("--isolation-policy", metavar="POLICY",
                       help="override the node label tke.cloud.tencent.com/qgpu-schedule-policy: "
                            "best-effort|be, fixed-share|fs, burst-share|bs (default: the label; best-effort without it)")
    serve.add_argument("--no-isolation", action="store_true",
                       help="do not run the isolation loop (device plugin, store and metrics only)")
    serve.add_argument("--proc-root", type=Path, default=Path("/proc"),
                       help="where GPU processes' cgroup and stat files are read (the host's /proc: run with hostPID)")
    serve.add_argument("--no-device-specs", action="store_true", help="leave /dev/nvidia* to the container runtime")
    serve.add_argument("--metrics-address", default="0.0.0.0")
    serve.add_argument("--metrics-port", type=int, default=5678, help="Prometheus /metrics port; -1 disables")
    serve.add_argument("--sample-interval", type=float, default=1.0, help="seconds between GPU samples")
    serve.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster, then ~/.kube/config)")
    serve.add_argument("--pods-file", type=Path,
                       help="read pods from this JSON file instead of the API (demos, hosts without an apiserver)")
    serve.add_argument("--no-node-labels", action="store_true", help="do not write GPU labels/annotations on the node")
    serve.add_argument("--dra", action="store_true",
                       help="serve qgpu as a DRA driver (gpu.qgpu.io): kubelet plugin and this node's ResourceSlice, no device plugins")
    serve.add_argument("--dra-unhealthy-effect", choices=UNHEALTHY_EFFECTS, default="NoSchedule",
                       help="with --dra: the effect of an unhealthy card's device taint; NoExecute has "
                            "kube-controller-manager evict the pods whose claims use the card")
    serve.add_argument("--cdi-dir", type=Path, default=Path("/var/run/cdi"),
                       help="with --dra: where CDI specs of prepared claims are written (a cdi_spec_dirs entry of the runtime)")
    serve.add_argument("--kubelet-plugins-dir", type=Path, default=Path("/var/lib/kubelet/plugins"),
                       help="with --dra: the DRA socket is <dir>/gpu.qgpu.io/dra.sock")
    serve.add_argument("--plugins-registry-dir", type=Path, default=Path("/var/lib/kubelet/plugins_registry"),
                       help="with --dra: kubelet's plugin watcher folder (registration socket gpu.qgpu.io-reg.sock)")
    serve.add_argument("--record-verify-key", type=Path, metavar="FILE",
                       help="the extender's Ed25519 public key (PEM): Allocate believes only allocation records it "
                            "signed. Required when pods come from the API and device plugins are served")
    add_largest_card_argument(serve, also="a card of this node larger than it is logged as a warning at start")
    serve.add_argument("--log-level", default="INFO")


def load_verify_key(path: Path | None, needed: bool) -> RecordVerifier | None:
    """The public key of --record-verify-key; raises ValueError naming the flag when it is needed and
    missing or unreadable. Why required: without it a tenant's own annotations would be believed."""
    from qgpu_runtime.contract.signature import RecordVerifier

    if path is None:
        if needed:
            raise ValueError("--record-verify-key is required: the node manager believes an allocation record only "
                             "when the extender's signature verifies with this public key (PEM); the "
                             "qgpu_manager role mounts it from the qgpu-record-verify-key ConfigMap")
        return None
    try:
        pem = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"--record-verify-key {path}: cannot read it ({exc.strerror})") from None
    return RecordVerifier.from_pem(pem, f"--record-verify-key {path}")


def _start(manager: NodeManager, stop: threading.Event, log: logging.Logger) -> int | None:
    """Start the manager; None when it serves, else the exit code (nothing is served then)."""
    from qgpu_runtime.gpu import BackendError
    from qgpu_runtime.node.manager import NodeUnreadable
    from qgpu_runtime.node.pods import PodSourceError

    try:
        if manager.start(until=stop):
            return None
    except PodSourceError as exc:  # retrying cannot help: wrong RBAC, node or credentials
        log.error("cannot start: %s", exc)
        return 1
    except (ValueError, NodeUnreadable, BackendError) as exc:  # bad or unreadable policy label; a failing GPU backend
        log.error("%s", exc)
        return 2
    log.info("stopped before the pods of node %s could be read", manager.config.node)
    return 0


class _Exit(Exception):
    """A start-up step failed; it logged why, and the command exits with ``code``."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def flag_problem(args: argparse.Namespace) -> str | None:
    """Flags refused before anything starts (the flag, the value and the rule), or None."""
    if not args.nodename:
        return "--nodename is required (or set NODE_NAME)"
    return (subdomain_problem("--nodename", args.nodename, "a node name")
            or log_level_problem("--log-level", args.log_level)
            or port_problem("--metrics-port", args.metrics_port, disabled=-1)
            or (address_problem("--metrics-address", args.metrics_address) if args.metrics_port != -1 else None))


def run(args: argparse.Namespace) -> int:
    """Configure, open the GPUs and the store, connect to the pods, start, serve until SIGTERM."""
    problem = flag_problem(args)
    if problem:
        print(f"qgpu manager serve: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("qgpu.manager")
    stop = _stop_on_signals()
    from qgpu_runtime.node.hostlock import LockError, acquire

    try:
        store_lock = acquire(args.dbfile, stop)  # held (open) for the process's life
    except LockError as exc:
        log.error("%s", exc)
        return 2
    if store_lock is None:
        log.info("stopped while waiting for the allocation store %s", args.dbfile)
        return 0
    try:
        return _serve(args, stop, log)
    finally:
        os.close(store_lock)  # the lock goes with it


def _serve(args: argparse.Namespace, stop: threading.Event, log: logging.Logger) -> int:
    """Open the GPUs and the store, connect to the pods, start, serve until ``stop``."""
    try:
        config, backend, store = _open(args, log)
        pods, slice_api = _pod_source(args, store, log)
    except _Exit as exc:
        return exc.code
    from qgpu_runtime.node.manager import NodeManager

    manager = NodeManager(config, backend, store, pods, isolation=_isolation(args, backend), slice_api=slice_api)
    code = _start(manager, stop, log)
    if code is not None:
        manager.stop()
        store.close()
        return code
    try:
        metrics = _serve_metrics(args, manager, log)
    except OSError as exc:  # the port is taken, or the address is not this host's
        log.error("--metrics-address %s --metrics-port %d: cannot listen: %s", args.metrics_address, args.metrics_port,
                  exc.strerror or exc)
        manager.stop()
        store.close()
        return 2
    log.info("serving %d card(s) (%s backend) as %s", len(manager.cards), backend.name,
             "DRA driver gpu.qgpu.io" if config.dra else ", ".join(k.name for k in config.resources))
    # A timed wait, never a bare ``stop.wait()``: the kernel may deliver SIGTERM to one of gRPC's
    # threads, and then only a main thread that wakes up on its own runs the Python handler.
    while not stop.wait(0.5):
        pass
    log.info("stopping")
    if metrics is not None:
        metrics.stop()
    manager.stop()
    store.close()
    return 0


def _config(args: argparse.Namespace):
    """The manager's settings from the flags; ValueError names a bad one."""
    from qgpu_runtime.node.deviceplugin.resources import parse_resources
    from qgpu_runtime.node.manager import ManagerConfig

    return ManagerConfig(
        node=args.nodename, resources=parse_resources(args.resources), plugin_dir=args.device_plugin_dir,
        pod_resources_socket=args.pod_resources_socket, state_dir=args.state_dir,
        isolation_policy=args.isolation_policy, pass_device_specs=not args.no_device_specs,
        sample_interval_s=args.sample_interval, label_node=not args.no_node_labels, proc_root=args.proc_root,
        # --tick and --memory-tolerance are shared with `serve --standalone` (qgpu_runtime/manager_cmd.py)
        isolation_tick_s=getattr(args, "tick_s", None) or 0.05,
        memory_tolerance_mib=getattr(args, "memory_tolerance_mib", None) or 0,
        dra=args.dra, dra_unhealthy_effect=args.dra_unhealthy_effect, cdi_dir=args.cdi_dir, kubelet_plugins_dir=args.kubelet_plugins_dir,
        plugins_registry_dir=args.plugins_registry_dir, limits=card_limits(args.largest_card_memory_mib),
        record_verifier=load_verify_key(args.record_verify_key, needed=not args.pods_file and not args.dra))


def _open(args: argparse.Namespace, log: logging.Logger):
    """(config, GPU backend, store), in that order; a failure exits 2."""
    from qgpu_runtime.gpu import BackendError, open_backend
    from qgpu_runtime.node.store import Store, StoreError

    try:
        config = _config(args)
        backend = open_backend(args.gpu_backend, args.simulated_gpus, seed=args.nodename)
        return config, backend, Store(args.dbfile)
    except (ValueError, BackendError, StoreError) as exc:
        log.error("%s", exc)
        raise _Exit(2) from None


def _pod_source(args: argparse.Namespace, store, log: logging.Logger):
    """(pods, the ResourceSlice API with --dra): the pods file, or the Kubernetes API; a failure
    closes the store and exits 2."""
    if args.pods_file:
        if args.dra:
            log.error("--dra reads ResourceClaims and publishes ResourceSlices through the Kubernetes API: it cannot run with --pods-file")
            store.close()
            raise _Exit(2)
        from qgpu_runtime.node.pods import FilePodSource

        source = FilePodSource(args.pods_file)
        try:
            source.pods_on_node(args.nodename)  # a file that is there must be a pod list (one written later is read then)
        except ValueError as exc:
            log.error("%s", exc)
            store.close()
            raise _Exit(2) from None
        return source, None
    from qgpu_runtime.node.kube_client import KubePodSource
    from qgpu_runtime.node.pods import PodSourceError

    try:
        pods = KubePodSource(args.kubeconfig)
    except PodSourceError as exc:
        log.error("%s", exc)
        store.close()
        raise _Exit(2) from None
    log.info("reading pods of node %s from the Kubernetes API at %s", args.nodename, pods.server)
    if not args.dra:
        return pods, None
    from qgpu_runtime.node.kube_client import KubeSlices

    return pods, KubeSlices(pods)


def _isolation(args: argparse.Namespace, backend):
    """The isolation backend, None with --no-isolation."""
    if args.no_isolation:
        return None
    from qgpu_runtime.node.enforcer import default_backend

    return default_backend(backend)


def _stop_on_signals() -> threading.Event:
    """Set by SIGTERM and SIGINT; SIGUSR1 dumps every thread's stack to stderr."""
    stop = threading.Event()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` dumps every thread's stack to stderr
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop


def _serve_metrics(args: argparse.Namespace, manager: NodeManager, log: logging.Logger) -> JsonServer | None:
    """``/metrics`` on --metrics-port (started), or None when it is -1."""
    if args.metrics_port < 0:
        return None
    from qgpu_runtime.serving import metrics_server

    server = metrics_server(args.metrics_address, args.metrics_port, manager.metrics.registry)
    log.info("metrics on http://%s:%d/metrics", args.metrics_address, server.port)
    return server
