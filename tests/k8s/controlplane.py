"""A real, local Kubernetes control plane for tests and benchmarks: etcd, kube-apiserver and
kube-scheduler built by scripts/k8s-testbin, listening on 127.0.0.1 only.

There is no kubelet: nodes are API objects whose status (capacity, allocatable, Ready) we patch
ourselves, which is all the scheduler looks at. Pods bound to them stay Pending with
``spec.nodeName`` set, which is exactly the state the extender and device plugin care about.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import yaml

from tests.k8s.pki import CertificateAuthority, KeyPair, service_account_keys
from tests.recordkeys import write_keys
from tests.tiers import CONTROLPLANE, refuse_in_fast_tier

ADMIN_USER = "qgpu-test-admin"  # the username of the admin kubeconfig (and of the session's extender)

ROOT = Path(__file__).resolve().parents[2]
TESTBIN = ROOT / "scripts" / "k8s-testbin"


def _die_with_parent() -> None:
    """Child-side: get SIGKILL when the test process dies, however it dies (a CI timeout's
    SIGKILL included), so no etcd or apiserver outlives the session that started it."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ControlPlaneError(RuntimeError):
    """A component did not start or become ready; the message carries the tail of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def testbin_dir(build: bool = True) -> Path:
    """Directory holding kube-apiserver, kube-scheduler and etcd; builds them when missing."""
    args = [str(TESTBIN)] + ([] if build else ["--print-dir"])
    out = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def kubeconfig(server: str, ca: Path, client: KeyPair, user: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "qgpu-test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(client.cert), "client-key": str(client.key)}}],
        "contexts": [{"name": "qgpu-test", "context": {"cluster": "qgpu-test", "user": user}}],
        "current-context": "qgpu-test",
    }


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def extender_config(
    url: str,
    *,
    ca_file: Path | None,
    node_cache_capable: bool = True,
    managed_resources: Iterable[str] = (),
    weight: int = 1,
    timeout: str = "10s",
    prioritize: bool = True,
    client_cert: KeyPair | None = None,
) -> dict[str, Any]:
    """One ``extenders`` entry of KubeSchedulerConfiguration v1 pointing at qgpu's extender;
    ``client_cert``: the certificate kube-scheduler presents (the extender refuses calls without)."""
    entry: dict[str, Any] = {
        "urlPrefix": url,
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize" if prioritize else "",
        "bindVerb": "bind",
        "weight": weight,
        "enableHTTPS": url.startswith("https://"),
        "httpTimeout": timeout,
        "nodeCacheCapable": node_cache_capable,
        "managedResources": [{"name": r, "ignoredByScheduler": True} for r in managed_resources],
        "ignorable": False,
    }
    if ca_file is not None:
        entry["tlsConfig"] = {"caFile": str(ca_file)}
        if client_cert is not None:
            entry["tlsConfig"].update(certFile=str(client_cert.cert), keyFile=str(client_cert.key))
    return entry


@dataclass
class ControlPlane:
    """etcd + kube-apiserver (+ kube-scheduler on demand) in a private directory."""

    bindir: Path
    workdir: Path
    processes: dict[str, Process] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pki_dir = self.workdir / "pki"
        self.ca = CertificateAuthority(self.pki_dir)
        self.apiserver_port = free_port()
        self.server = f"https://127.0.0.1:{self.apiserver_port}"
        self.admin = self.ca.issue("admin", ADMIN_USER, organization="system:masters", client=True)
        self.scheduler_client = self.ca.issue("scheduler", "system:kube-scheduler", client=True)
        self.serving = self.ca.issue("apiserver", "kube-apiserver", server=True,
                                     hosts=("127.0.0.1", "localhost", "kubernetes", "kubernetes.default",
                                            "kubernetes.default.svc", "10.96.0.1"))
        self.sa = service_account_keys(self.pki_dir)
        # The client certificate kube-apiserver presents to admission webhooks (its admission
        # configuration), signed by a CA of the webhook's own: `qgpu webhook serve --client-ca-file`.
        self.webhook_client_ca = CertificateAuthority(self.pki_dir / "webhook-client", "qgpu-webhook-client-ca")
        self.webhook_client = self.webhook_client_ca.issue("kube-apiserver", "kube-apiserver", client=True)
        self.admission_config = self._write_admission_config()
        self.admin_kubeconfig = self._write_yaml("admin.kubeconfig", kubeconfig(self.server, self.ca.cert_path, self.admin, "admin"))
        self.scheduler_kubeconfig = self._write_yaml(
            "scheduler.kubeconfig", kubeconfig(self.server, self.ca.cert_path, self.scheduler_client, "kube-scheduler"))

    def _write_admission_config(self) -> Path:
        """AdmissionConfiguration for both webhook admission plugins, naming a kubeconfig whose
        user ``*`` (every webhook: the tests' webhooks listen on ports chosen at run time) presents
        :attr:`webhook_client`. The roles name the webhook's own host instead (admission-*.j2)."""
        users = self._write_yaml("admission-webhooks.kubeconfig", {
            "apiVersion": "v1", "kind": "Config",
            "users": [{"name": "*", "user": {"client-certificate": str(self.webhook_client.cert),
                                             "client-key": str(self.webhook_client.key)}}]})
        plugin = {"apiVersion": "apiserver.config.k8s.io/v1", "kind": "WebhookAdmissionConfiguration", "kubeConfigFile": str(users)}
        return self._write_yaml("admission.yaml", {
            "apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration",
            "plugins": [{"name": "ValidatingAdmissionWebhook", "configuration": plugin},
                        {"name": "MutatingAdmissionWebhook", "configuration": plugin}]})

    def webhook_auth_args(self) -> list[str]:
        """`qgpu webhook serve` flags that accept this apiserver's admission client certificate."""
        return ["--client-ca-file", str(self.webhook_client_ca.cert_path)]

    # -- lifecycle --------------------------------------------------------------------------------

    def _write_yaml(self, name: str, doc: Mapping[str, Any]) -> Path:
        path = self.workdir / name
        path.write_text(yaml.safe_dump(dict(doc), sort_keys=False))
        return path

    def _spawn(self, name: str, argv: list[str]) -> Process:
        log = self.workdir / f"{name}.log"
        handle = open(log, "wb")
        popen = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, preexec_fn=_die_with_parent)
        handle.close()
        proc = Process(name, popen, log)
        self.processes[name] = proc
        return proc

    def _wait(self, proc: Process, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise ControlPlaneError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            try:
                if ready():
                    return
            except (OSError, ssl.SSLError):
                pass
            time.sleep(0.2)
        raise ControlPlaneError(f"{proc.name} not ready after {timeout:.0f}s:\n{proc.tail()}")

    def start(self, timeout: float = 120.0) -> None:
        refuse_in_fast_tier("starts a control plane (etcd, kube-apiserver)", CONTROLPLANE)
        self._start_etcd(timeout)
        self._start_apiserver(timeout)

    def _start_etcd(self, timeout: float) -> None:
        client, peer = free_port(), free_port()
        shm = Path("/dev/shm")
        data = Path(tempfile.mkdtemp(prefix="qgpu-etcd-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
        self._etcd_data = data
        self.etcd_url = f"http://127.0.0.1:{client}"
        proc = self._spawn("etcd", [
            str(self.bindir / "etcd"), "--name", "qgpu-test", "--data-dir", str(data),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"qgpu-test=http://127.0.0.1:{peer}", "--unsafe-no-fsync",
            "--log-level", "warn",
        ])

        def ready() -> bool:
            with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as r:
                return json.load(r).get("health") == "true"

        self._wait(proc, ready, timeout)

    def _start_apiserver(self, timeout: float) -> None:
        proc = self._spawn("kube-apiserver", [
            str(self.bindir / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.apiserver_port}",
            f"--tls-cert-file={self.serving.cert}", f"--tls-private-key-file={self.serving.key}",
            f"--client-ca-file={self.ca.cert_path}",
            f"--service-account-key-file={self.sa.cert}", f"--service-account-signing-key-file={self.sa.key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--authorization-mode=RBAC",
            # The kubernetes Service endpoints cannot point at loopback; nothing here needs them.
            "--endpoint-reconciler-type=none",
            # No controller-manager runs, so nothing creates the "default" service account that
            # ServiceAccount insists on, and nothing would lift the not-ready taint that
            # TaintNodesByCondition puts on every new node.
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
            f"--admission-control-config-file={self.admission_config}",
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            "--max-requests-inflight=2000", "--max-mutating-requests-inflight=1000",
            "--profiling=false", "--v=1",
        ])
        ctx = self.ssl_context()

        def ready() -> bool:
            with urllib.request.urlopen(f"{self.server}/readyz", timeout=5, context=ctx) as r:
                return r.status == 200

        self._wait(proc, ready, timeout)

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca.cert_path))
        ctx.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        return ctx

    def start_scheduler(self, extenders: list[dict[str, Any]], *, timeout: float = 60.0, qps: int = 1000) -> Process:
        """(Re)start kube-scheduler with KubeSchedulerConfiguration v1 naming these extenders."""
        self.stop_scheduler()
        config = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(self.scheduler_kubeconfig), "qps": qps, "burst": qps * 2},
            "leaderElection": {"leaderElect": False},
            "extenders": extenders,
        }
        return self.start_scheduler_from_file(self._write_yaml("scheduler-config.yaml", config), timeout=timeout)

    def start_scheduler_from_file(self, config: Path, *, name: str = "kube-scheduler", timeout: float = 60.0) -> Process:
        """(Re)start kube-scheduler ``name`` with ``--config`` pointing at an existing file (e.g. one an
        Ansible role rendered) and wait until it answers ``/readyz``: a config kube-scheduler refuses
        makes it exit, which raises :class:`ControlPlaneError` with its log."""
        self._stop_process(name)
        path = config
        port = free_port()
        self.scheduler_port = port
        proc = self._spawn(name, [
            str(self.bindir / "kube-scheduler"), f"--config={path}",
            "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--authentication-kubeconfig={self.scheduler_kubeconfig}",
            f"--authorization-kubeconfig={self.scheduler_kubeconfig}",
            "--authentication-skip-lookup=true",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            "--v=2",
        ])
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE

        def ready() -> bool:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", timeout=2, context=ctx) as r:
                return r.status == 200

        self._wait(proc, ready, timeout)
        return proc

    def stop_scheduler(self, name: str = "kube-scheduler") -> None:
        self._stop_process(name)

    def _stop_process(self, name: str) -> None:
        proc = self.processes.pop(name, None)
        if proc is not None:
            proc.stop()

    def stop(self) -> None:
        # Extra schedulers (start_scheduler_from_file with another name) first, etcd last.
        for name in [n for n in self.processes if n not in ("kube-apiserver", "etcd")] + ["kube-apiserver", "etcd"]:
            self._stop_process(name)
        data = getattr(self, "_etcd_data", None)
        if data is not None:
            shutil.rmtree(data, ignore_errors=True)


@dataclass
class QgpuServer:
    """`qgpu extender serve` or `qgpu webhook serve` as a child process, as it runs in production."""

    name: str
    argv: list[str]
    workdir: Path
    port: int
    scheme: str = "https"
    ca_file: Path | None = None
    process: Process | None = None
    client_cert: KeyPair | None = None  # what kube-scheduler presents to an extender with a client CA
    module: str = "qgpu_runtime.cli"  # what `python -m` runs (bench/null_extender.py: bench.null_extender)
    source: Path = ROOT  # the checkout whose code runs (bench/extender_bench.py --compare-source: another one)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def ssl_context(self, *, client_cert: bool = True) -> ssl.SSLContext | None:
        """A client context trusting the server (and presenting the scheduler's certificate)."""
        if self.ca_file is None:
            return None
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        if client_cert and self.client_cert is not None:
            ctx.load_cert_chain(str(self.client_cert.cert), str(self.client_cert.key))
        return ctx

    def scheduler_config(self, **kwargs: Any) -> dict[str, Any]:
        """:func:`extender_config` for this server, with its CA and client certificate."""
        return extender_config(self.url, ca_file=self.ca_file, client_cert=self.client_cert, **kwargs)

    def requests_by_verb(self) -> dict[str, float]:
        """The extender's ``qgpu_extender_requests_total`` summed by verb, from its /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=5, context=self.ssl_context()) as response:
            text = response.read().decode()
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "qgpu_extender_requests_total":
                    counts[sample.labels["verb"]] = counts.get(sample.labels["verb"], 0) + sample.value
        return counts

    def start(self, timeout: float = 60.0, ready_path: str = "/readyz") -> None:
        import sys

        log = self.workdir / f"{self.name}.log"
        handle = open(log, "ab")
        env = {**os.environ, "PYTHONPATH": str(self.source)}
        popen = subprocess.Popen([sys.executable, "-m", self.module, *self.argv], stdout=handle,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.source, env=env,
                                 start_new_session=True, preexec_fn=_die_with_parent)
        handle.close()
        self.process = Process(self.name, popen, log)
        ctx = self.ssl_context()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if popen.poll() is not None:
                raise ControlPlaneError(f"{self.name} exited with {popen.returncode}:\n{self.process.tail()}")
            try:
                with urllib.request.urlopen(self.url + ready_path, timeout=2, context=ctx) as r:
                    if r.status == 200:
                        return
            except (OSError, ssl.SSLError):
                pass
            time.sleep(0.1)
        raise ControlPlaneError(f"{self.name} not ready after {timeout:.0f}s:\n{self.process.tail()}")

    def kill9(self) -> None:
        """SIGKILL, no goodbye: what a crashed or OOM-killed extender looks like."""
        if self.process is not None and self.process.popen.poll() is None:
            self.process.popen.send_signal(signal.SIGKILL)
            self.process.popen.wait(10)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def extender_server(cp: ControlPlane, *, priority: str = "binpack", tls: bool = True, port: int | None = None,
                    assume_timeout: float = 30.0, filter_result: str = "all", kubeconfig: Path | None = None,
                    extra_args: Iterable[str] = (), name: str = "qgpu-extender", source: Path = ROOT) -> QgpuServer:
    """`qgpu extender serve` against ``cp`` (as the cluster admin unless another ``kubeconfig`` is given);
    ``extra_args`` are appended to its command line, ``name`` names its log, ``source`` is the
    checkout whose code runs (this one unless a benchmark compares another).

    ``tls``: HTTPS with client certificates, as in production: a CA of the extender's own (not the
    cluster's, whose admin certificate would otherwise pass) signs its serving certificate and the
    one kube-scheduler presents. Without: plain HTTP on loopback (``--insecure-plain-http``), for
    tests that are not about the transport."""
    port = port or free_port()
    signing_key, _ = write_keys(cp.workdir / "record-keys")  # the tests' key, as the roles mount theirs
    argv = ["extender", "serve", "--address", "127.0.0.1", "--port", str(port), "--priority", priority,
            "--kubeconfig", str(kubeconfig or cp.admin_kubeconfig), "--assume-timeout", str(assume_timeout),
            "--filter-result", filter_result, "--record-signing-key", str(signing_key), *extra_args]
    if not tls:
        return QgpuServer(name, [*argv, "--insecure-plain-http"], cp.workdir, port, "http", source=source)
    ca = extender_ca(cp)
    pair = ca.issue("extender", "qgpu-extender", server=True, hosts=("127.0.0.1", "localhost"))
    scheduler = ca.issue("kube-scheduler", "system:kube-scheduler", client=True)
    argv += ["--tls-cert-file", str(pair.cert), "--tls-private-key-file", str(pair.key), "--client-ca-file", str(ca.cert_path)]
    return QgpuServer(name, argv, cp.workdir, port, "https", ca.cert_path, client_cert=scheduler, source=source)


def extender_ca(cp: ControlPlane) -> CertificateAuthority:
    """The extender's CA for this control plane, created on first use."""
    directory = cp.workdir / "extender-pki"
    if (directory / "ca.crt").exists():
        return CertificateAuthority.load(directory)
    return CertificateAuthority(directory, "qgpu-extender-ca")
