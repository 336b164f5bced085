"""A whole Kubernetes cluster on this machine: etcd, kube-apiserver, kube-controller-manager,
containerd, a real kubelet and kube-scheduler (a static pod of that kubelet, as kubeadm runs it),
all on 127.0.0.1, one node called ``localhost``.

Used by ``scripts/local-cluster up|down|status`` (persistent daemons, state in a directory) and by
the real-node tests (tests/realnode/conftest.py). ``up`` is idempotent: components that still
answer are kept, the others are started; ``down`` stops everything and removes what was made.

Leaving the host as it was found is a design goal, reached this way:
- containerd, the kubelet and everything they start (shims, runc, the CNI plugin, containers'
  hostPath volumes) live in one private **mount namespace** held open by a ``sleep`` process. In it
  ``/var/lib`` and ``/run`` are fresh tmpfs mounts, and ``/var/lib/kubelet``, ``/var/lib/qgpu`` and
  ``/var/log/pods`` are bind mounts of folders under the cluster's directory. The kubelet's
  hard-coded device-plugin path, the default pod-resources socket and the manifests' hostPath
  volumes therefore work unchanged, nothing is written to the host's /var or /run, and every mount
  disappears with the namespace at ``down``.
- pods' cgroups go under ``cgroupRoot`` ``/qgpu-<cluster id>`` in every v1 hierarchy; ``down``
  removes that tree.
- the kubelet changes three global sysctls at start (vm.overcommit_memory, kernel.panic,
  kernel.panic_on_oops): ``up`` records their values before the first kubelet start and ``down``
  restores them.
- pods get a loopback-only network (assets/qgpu-lo): no bridge, route or iptables rule.

Networking facts that shape the deployment (docs/local-cluster.md): nothing implements Service
IPs here (no kube-proxy), and the kubelet will not report 127.0.0.1 as the node's address, so the
qgpu components run with host networking and reach the apiserver at 127.0.0.1 (the roles'
``qgpu_kube_apiserver_host``/``_port`` variables), and the webhook is called by URL on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the tests package lives in the checkout
    sys.path.insert(0, str(ROOT))

from tests.k8s.controlplane import kubeconfig  # noqa: E402
from tests.k8s.pki import CertificateAuthority, KeyPair, service_account_keys  # noqa: E402
from tests.realnode.images import PAUSE_REF as PAUSE_IMAGE  # noqa: E402
from tests.realnode.images import kube_scheduler_ref  # noqa: E402

ASSETS = Path(__file__).resolve().parent / "assets"
NODE = "localhost"
QGPU_NAMESPACE = "qgpu-system"  # inventories/local-cluster: qgpu_namespace, where the roles put qgpu
KUBELET_SYSCTLS = ("vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops")
CGROUP_V1 = Path("/sys/fs/cgroup")
SIMULATED_CONTROL = "/var/lib/qgpu/simulated-control.json"  # as the manager pod sees it
IMAGE_CACHE = ROOT / ".cache" / "local-cluster" / "images"  # shared by every cluster: inputs key each archive
CERT_DAYS = 30  # a local cluster lives for days; `down` and `up` make new ones


class ClusterError(RuntimeError):
    """A component did not start or become ready; the message carries the tail of its log."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class State:
    """What ``up`` chose once and ``down`` needs: ports, pids, saved sysctls. Kept in state.json."""

    cluster_id: str
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    sysctls: dict[str, str] = field(default_factory=dict)
    dra: bool = False

    @classmethod
    def load(cls, path: Path) -> State | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)


class LocalCluster:
    """One cluster in ``workdir``; binaries from scripts/k8s-testbin and scripts/containerd-bin."""

    def __init__(self, workdir: Path, k8s_bin: Path, containerd_bin: Path, *, log: Callable[[str], None] = print,
                 persistent: bool = True, simulated_cards: list[dict[str, Any]] | None = None,
                 dra: bool | None = None) -> None:
        self.dir = workdir.resolve()
        self.k8s_bin = k8s_bin
        self.containerd_bin = containerd_bin
        self.log = log
        self.persistent = persistent  # False: children die with this process (tests)
        self.simulated_cards = simulated_cards or [{"model": "V100", "memory_mib": 32768, "count": 2}]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_file = self.dir / "state.json"
        state = State.load(self.state_file)
        if state is None:
            state = State(cluster_id=hashlib.sha256(str(self.dir).encode()).hexdigest()[:8])
        if dra is not None and dra != state.dra:
            state.dra = dra
            state.save(self.state_file)
        self.state = state
        self.logs = self.dir / "logs"
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self.pki = self.dir / "pki"

    # ---- paths and names -------------------------------------------------------------------
    @property
    def cgroup_root(self) -> str:
        return f"/qgpu-{self.state.cluster_id}"

    @property
    def dra(self) -> bool:
        """The GPU pool serves its cards through DRA (ResourceSlices, claims, CDI), not device plugins.
        Chosen at the first ``up`` and kept in state.json, so a second ``up`` keeps the mode."""
        return self.state.dra

    @property
    def containerd_socket(self) -> Path:
        return self.dir / "containerd" / "containerd.sock"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.state.ports['apiserver']}"

    def port(self, name: str) -> int:
        if name not in self.state.ports:
            self.state.ports[name] = _free_port()
            self.state.save(self.state_file)
        return self.state.ports[name]

    # ---- processes ---------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], *, env: dict[str, str] | None = None, in_namespace: bool = False) -> int:
        self.logs.mkdir(parents=True, exist_ok=True)
        if in_namespace:
            argv = ["nsenter", f"--mount=/proc/{self.state.pids['mountns']}/ns/mnt", "--", *argv]
        if not self.persistent:
            argv = ["setpriv", "--pdeathsig", "KILL", "--", *argv]
        with open(self.logs / f"{name}.log", "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, **(env or {})}, cwd=self.dir)
        self.state.pids[name] = popen.pid
        self.state.save(self.state_file)
        self._children[name] = popen
        return popen.pid

    def running(self, name: str) -> bool:
        popen = self._children.get(name)
        if popen is not None and popen.poll() is not None:
            return False
        return _alive(self.state.pids.get(name))

    def _wait(self, name: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running(name):
                raise ClusterError(f"{name} exited:\n{_tail(self.logs / f'{name}.log')}")
            try:
                if ready():
                    return
            except (OSError, ssl.SSLError, subprocess.SubprocessError):
                pass
            time.sleep(0.2)
        raise ClusterError(f"{name} not ready after {timeout:.0f}s:\n{_tail(self.logs / f'{name}.log')}")

    def _stop(self, name: str, timeout: float = 15.0) -> None:
        pid = self.state.pids.pop(name, None)
        if pid and _alive(pid):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        popen = self._children.pop(name, None)
        if popen is not None:
            try:
                popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.state.save(self.state_file)

    def _https_ok(self, url: str, ctx: ssl.SSLContext) -> bool:
        with urllib.request.urlopen(url, timeout=3, context=ctx) as r:
            return r.status == 200

    def _admin_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    # ---- up ----------------------------------------------------------------------------------
    def up(self, timeout: float = 120.0) -> None:
        """Start what is not running; every step says what it does (a first start takes ~30 s)."""
        self._pki()
        self._etcd(timeout)
        self._apiserver(timeout)
        self._controller_manager(timeout)
        self._mount_namespace()
        self._containerd(timeout)
        self._images()
        self._scheduler_manifest()
        self._simulated_gpus()
        self._kubelet(timeout)
        self._wait_node_ready(timeout)
        self._label_control_plane()

    def _pki(self) -> None:
        if (self.pki / "ca.crt").exists():
            self.ca = CertificateAuthority.load(self.pki, days=CERT_DAYS)
            return
        self.log("pki: a CA and the certificates of every component")
        self.ca = CertificateAuthority(self.pki, common_name="qgpu-local-ca", days=CERT_DAYS)
        self.ca.issue("admin", "qgpu-local-admin", organization="system:masters", client=True)
        self.ca.issue("apiserver", "kube-apiserver", server=True,
                      hosts=("127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                             "10.96.0.1"))
        self.ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", organization="system:masters",
                      client=True)
        self.ca.issue("controller-manager", "system:kube-controller-manager", client=True)
        self.ca.issue("scheduler", "system:kube-scheduler", client=True)
        self.ca.issue("kubelet-client", f"system:node:{NODE}", organization="system:nodes", client=True)
        self.ca.issue("kubelet-serving", f"system:node:{NODE}", server=True, hosts=("127.0.0.1", NODE))
        service_account_keys(self.pki)

    def _webhook_client(self) -> Path:
        """The client certificate kube-apiserver presents to the qgpu webhook, signed by a CA of the
        webhook's own (the role's --client-ca-file, qgpu_webhook_client_ca_pem), and the admission
        configuration naming it for the webhook's URL host only; what kube_apiserver_admission
        writes on a kubeadm master. Returns the configuration file."""
        directory = self.pki / "webhook-client"
        if not (directory / "ca.crt").exists():
            CertificateAuthority(directory, common_name="qgpu-local-webhook-client-ca", days=CERT_DAYS).issue(
                "kube-apiserver", "kube-apiserver-qgpu-webhook-client", client=True)
        users = self.dir / "admission-webhooks.kubeconfig"
        users.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "users": [{
            "name": f"127.0.0.1:{self.port('webhook')}",
            "user": {"client-certificate": str(directory / "kube-apiserver.crt"), "client-key": str(directory / "kube-apiserver.key")}}]}))
        plugin = {"apiVersion": "apiserver.config.k8s.io/v1", "kind": "WebhookAdmissionConfiguration", "kubeConfigFile": str(users)}
        config = self.dir / "admission.yaml"
        config.write_text(yaml.safe_dump({"apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration", "plugins": [
            {"name": "ValidatingAdmissionWebhook", "configuration": plugin}, {"name": "MutatingAdmissionWebhook", "configuration": plugin}]}))
        return config

    def _pair(self, name: str) -> KeyPair:
        return KeyPair(self.pki / f"{name}.crt", self.pki / f"{name}.key")

    def _write_kubeconfigs(self) -> None:
        ca = self.pki / "ca.crt"
        for file, pair, user in (("admin.kubeconfig", "admin", "admin"),
                                 ("controller-manager.kubeconfig", "controller-manager", "kube-controller-manager"),
                                 ("scheduler.kubeconfig", "scheduler", "kube-scheduler"),
                                 ("kubelet.kubeconfig", "kubelet-client", f"system:node:{NODE}")):
            (self.dir / file).write_text(yaml.safe_dump(kubeconfig(self.server, ca, self._pair(pair), user)))

    def _etcd(self, timeout: float) -> None:
        url = f"http://127.0.0.1:{self.port('etcd')}"

        def ready() -> bool:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return json.load(r).get("health") == "true"

        if self.running("etcd"):
            return
        self.log(f"etcd: starting on {url}")
        peer = f"http://127.0.0.1:{self.port('etcd-peer')}"
        self._spawn("etcd", [
            str(self.k8s_bin / "etcd"), "--name", "qgpu-local", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"qgpu-local={peer}", "--unsafe-no-fsync", "--log-level", "warn"])
        self._wait("etcd", ready, timeout)

    def _apiserver(self, timeout: float) -> None:
        self.port("apiserver")
        self._write_kubeconfigs()
        if self.running("kube-apiserver"):
            return
        self.log(f"kube-apiserver: starting on {self.server}")
        p = self.pki
        admission = self._webhook_client()
        self._spawn("kube-apiserver", [
            str(self.k8s_bin / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.port('etcd')}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port('apiserver')}",
            f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            f"--service-account-key-file={p / 'sa.pub'}", f"--service-account-signing-key-file={p / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.96.0.0/16",
            # The node's own identity is confined to its node and its pods, as on a kubeadm cluster.
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            # The kubelet's address is its name (localhost): it refuses to report 127.0.0.1 itself.
            "--kubelet-preferred-address-types=Hostname",
            f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={p / 'ca.crt'}",
            # The kubernetes Service cannot point at loopback; pods reach the apiserver at 127.0.0.1.
            "--endpoint-reconciler-type=none",
            f"--admission-control-config-file={admission}",
            "--allow-privileged=true", "--profiling=false", "--v=1"])
        ctx = self._admin_context()
        self._wait("kube-apiserver", lambda: self._https_ok(f"{self.server}/readyz", ctx), timeout)

    def _controller_manager(self, timeout: float) -> None:
        if self.running("kube-controller-manager"):
            return
        self.log("kube-controller-manager: starting (service accounts and tokens, DaemonSets, Deployments, "
                 "garbage collection, node lifecycle, disruption budgets, resource claims)")
        port = self.port("controller-manager")
        p = self.pki
        kc = self.dir / "controller-manager.kubeconfig"
        self._spawn("kube-controller-manager", [
            str(self.k8s_bin / "kube-controller-manager"), f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", "--leader-elect=false",
            "--use-service-account-credentials=true",
            f"--root-ca-file={p / 'ca.crt'}", f"--service-account-private-key-file={p / 'sa.key'}",
            f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
            "--controllers=*",  # the defaults; cloud and IPAM controllers idle without a cloud or CIDRs
            "--node-monitor-grace-period=20s", "--v=1"])
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        self._wait("kube-controller-manager", lambda: self._https_ok(f"https://127.0.0.1:{port}/healthz", ctx), timeout)

    def _mount_namespace(self) -> None:
        if self.running("mountns"):
            return
        self.log("mount namespace: tmpfs over /var/lib and /run, the kubelet's, qgpu's and the pod logs' folders bound in")
        binds = {"kubelet": "/var/lib/kubelet", "qgpu": "/var/lib/qgpu", "pod-logs": "/var/log/pods"}
        for sub in binds:
            (self.dir / "host" / sub).mkdir(parents=True, exist_ok=True)
        script = ["set -e", "mount -t tmpfs -o mode=0755 qgpu-var-lib /var/lib", "mount -t tmpfs -o mode=0755 qgpu-run /run",
                  "mkdir -p /run/lock /var/log/pods"]
        for sub, target in binds.items():
            if target.startswith("/var/log"):
                script.append(f"mount --bind {self.dir / 'host' / sub} {target}")
            else:
                script += [f"mkdir -p {target}", f"mount --bind {self.dir / 'host' / sub} {target}"]
        script.append("mount --make-rshared /var/lib/kubelet")
        script.append("exec sleep infinity")
        self._spawn("mountns", ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "\n".join(script)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not self.running("mountns"):
                raise ClusterError(f"mount namespace holder exited:\n{_tail(self.logs / 'mountns.log')}")
            if Path(f"/proc/{self.state.pids['mountns']}/comm").read_text().strip() == "sleep":
                return
            time.sleep(0.05)
        raise ClusterError("mount namespace holder did not finish its mounts in 10 s")

    def _containerd(self, timeout: float) -> None:
        root = self.dir / "containerd"
        cni_bin, cni_conf = self.dir / "cni" / "bin", self.dir / "cni" / "conf"
        cdi = self.dir / "cdi"
        for d in (root, cni_bin, cni_conf, cdi):
            d.mkdir(parents=True, exist_ok=True)
        for name in ("qgpu-lo", "loopback"):
            shutil.copy2(ASSETS / "qgpu-lo", cni_bin / name)
        (cni_conf / "10-qgpu-lo.conflist").write_text(json.dumps(
            {"cniVersion": "1.0.0", "name": "qgpu-lo", "plugins": [{"type": "qgpu-lo"}]}))
        config = root / "config.toml"
        # CDI on in both modes (DRA needs it); /var/run/cdi is the DRA manager's default spec folder,
        # a tmpfs of the mount namespace.
        config.write_text(_containerd_config(root, cni_bin, cni_conf, (cdi, Path("/var/run/cdi"))))
        if self.running("containerd"):
            return
        self.log(f"containerd: starting on {self.containerd_socket}")
        # Its own shim first on PATH: Debian's containerd 1.6 shim may be installed too.
        path = f"{self.containerd_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        self._spawn("containerd", [str(self.containerd_bin / "containerd"), "--config", str(config)],
                    env={"PATH": path}, in_namespace=True)
        self._wait("containerd", lambda: self._ctr("version").returncode == 0, timeout)

    def ctr(self, *args: str, check: bool = True, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        out = self._ctr(*args, input=input)
        if check and out.returncode != 0:
            raise ClusterError(f"ctr {' '.join(args)}: {out.stderr.decode(errors='replace')}")
        return out

    def _ctr(self, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([str(self.containerd_bin / "ctr"), "--address", str(self.containerd_socket),
                               "--namespace", "k8s.io", *args], capture_output=True, input=input, timeout=120)

    def image_present(self, ref: str) -> bool:
        out = self.ctr("images", "list", "--quiet", check=False)
        return ref in out.stdout.decode().split()

    def import_image(self, archive: Path, ref: str) -> None:
        if self.image_present(ref):
            return
        self.log(f"containerd: importing {ref}")
        self.ctr("images", "import", "--no-unpack", str(archive))

    def _images(self) -> None:
        from tests.realnode import images

        cache = IMAGE_CACHE
        self.import_image(images.pause_image(cache), PAUSE_IMAGE)
        self.import_image(images.kube_scheduler_image(cache, self.k8s_bin), kube_scheduler_ref())

    def _scheduler_manifest(self) -> None:
        """kube-scheduler as a static pod, the way kubeadm writes it: written once; afterwards it
        belongs to the kube_scheduler_extender role, which wires the qgpu extender into it."""
        path = self.dir / "manifests" / "kube-scheduler.yaml"
        path.parent.mkdir(exist_ok=True)
        if path.exists():
            return
        kc, pki = self.dir / "scheduler.kubeconfig", self.pki
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "kube-scheduler", "namespace": "kube-system",
                         "labels": {"component": "kube-scheduler", "tier": "control-plane"}},
            "spec": {
                "hostNetwork": True, "priorityClassName": "system-node-critical",
                "containers": [{
                    "name": "kube-scheduler", "image": kube_scheduler_ref(), "imagePullPolicy": "Never",
                    "command": ["kube-scheduler", f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
                                f"--authorization-kubeconfig={kc}", "--bind-address=127.0.0.1",
                                f"--secure-port={self.port('scheduler')}", "--leader-elect=false",
                                "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics"],
                    "resources": {"requests": {"cpu": "100m"}},
                    "volumeMounts": [{"name": "kubeconfig", "mountPath": str(kc), "readOnly": True},
                                     {"name": "pki", "mountPath": str(pki), "readOnly": True}]}],
                "volumes": [{"name": "kubeconfig", "hostPath": {"path": str(kc), "type": "File"}},
                            {"name": "pki", "hostPath": {"path": str(pki), "type": "Directory"}}]}}
        path.write_text(yaml.safe_dump(pod, sort_keys=False))

    def _simulated_gpus(self) -> None:
        """The node manager's simulated cards, with a control file the tests write GPU processes
        into (qgpu_runtime/gpu/simulated.py). Seen by the manager pod at /var/lib/qgpu (hostPath)."""
        config = self.dir / "host" / "qgpu" / "simulated-gpus.yaml"
        if not config.exists():
            config.write_text(yaml.safe_dump({"cards": self.simulated_cards, "control": SIMULATED_CONTROL}))
        control = self.dir / "host" / "qgpu" / Path(SIMULATED_CONTROL).name
        if not control.exists():
            control.write_text("{}\n")

    def simulated_control(self) -> Path:
        """The control file on this side of the mount namespace."""
        return self.dir / "host" / "qgpu" / Path(SIMULATED_CONTROL).name

    def _label_control_plane(self) -> None:
        """kubeadm labels its masters so; the kubelet may not (NodeRestriction), the admin does."""
        body = json.dumps({"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}}).encode()
        req = urllib.request.Request(f"{self.server}/api/v1/nodes/{NODE}", data=body, method="PATCH",
                                     headers={"Content-Type": "application/merge-patch+json"})
        with urllib.request.urlopen(req, timeout=10, context=self._admin_context()) as r:
            r.read()

    def _kubelet(self, timeout: float) -> None:
        port, healthz = self.port("kubelet"), self.port("kubelet-healthz")
        manifests = self.dir / "manifests"
        manifests.mkdir(exist_ok=True)
        self._save_sysctls()
        self._cgroups()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "address": "127.0.0.1", "port": port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": healthz,
            "tlsCertFile": str(self.pki / "kubelet-serving.crt"), "tlsPrivateKeyFile": str(self.pki / "kubelet-serving.key"),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.pki / "ca.crt")}},
            "authorization": {"mode": "Webhook"},
            "staticPodPath": str(manifests), "fileCheckFrequency": "2s", "failSwapOn": False, "resolvConf": "/etc/resolv.conf",
            # Local images cannot be pulled again: never collect them.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%", "imagefs.inodesFree": "1%"},
            "rotateCertificates": False, "serverTLSBootstrap": False,
            "nodeStatusUpdateFrequency": "4s", "nodeStatusReportFrequency": "10s", "syncFrequency": "10s",
            "shutdownGracePeriod": "0s", "shutdownGracePeriodCriticalPods": "0s", "registerNode": True,
            # No CAP_SYS_RESOURCE on these machines: the kubelet cannot lower its own OOM score.
            "oomScoreAdj": 0,
            "volumePluginDir": "/var/lib/kubelet/volume-plugins",
        }
        path = self.dir / "kubelet-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        if self.running("kubelet"):
            return
        self.log(f"kubelet: starting (node {NODE}, cgroup root {self.cgroup_root})")
        self._spawn("kubelet", [str(self.k8s_bin / "kubelet"), f"--config={path}",
                                f"--kubeconfig={self.dir / 'kubelet.kubeconfig'}", f"--hostname-override={NODE}",
                                "--v=1"], in_namespace=True)
        self._wait("kubelet", lambda: urllib.request.urlopen(f"http://127.0.0.1:{healthz}/healthz", timeout=2).status == 200,
                   timeout)

    def restart_kubelet(self, timeout: float = 60.0) -> None:
        self._stop("kubelet")
        self._kubelet(timeout)

    def _save_sysctls(self) -> None:
        if self.state.sysctls:
            return
        for key in KUBELET_SYSCTLS:
            self.state.sysctls[key] = Path("/proc/sys", *key.split(".")).read_text().strip()
        self.state.save(self.state_file)

    def _cgroups(self) -> None:
        for hierarchy in _v1_hierarchies():
            (hierarchy / self.cgroup_root.lstrip("/")).mkdir(exist_ok=True)

    def _wait_node_ready(self, timeout: float) -> None:
        ctx = self._admin_context()

        def ready() -> bool:
            with urllib.request.urlopen(f"{self.server}/api/v1/nodes/{NODE}", timeout=3, context=ctx) as r:
                node = json.load(r)
            return any(c.get("type") == "Ready" and c.get("status") == "True"
                       for c in (node.get("status") or {}).get("conditions") or [])

        self._wait("kubelet", ready, timeout)
        self.log(f"node {NODE}: Ready")

    # ---- down --------------------------------------------------------------------------------
    def down(self) -> None:
        """Stop everything, containers first; restore sysctls; remove cgroups and the directory."""
        if self.running("kubelet"):
            self.log("kubelet: stopping")
        self._stop("kubelet")
        self._stop_containers()
        for name in ("containerd", "mountns", "kube-controller-manager", "kube-apiserver", "etcd"):
            if self.running(name):
                self.log(f"{name}: stopping")
            self._stop(name)
        self._kill_leftover_shims()
        for key, value in self.state.sysctls.items():
            Path("/proc/sys", *key.split(".")).write_text(value)
        self._remove_cgroups()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.log(f"removed {self.dir}")

    def _stop_containers(self) -> None:
        """Kill every task of our containerd: its shims outlive containerd otherwise."""
        if not self.running("containerd"):
            return
        tasks = self._ctr("tasks", "list", "--quiet")
        for task in tasks.stdout.decode().split():
            self._ctr("tasks", "kill", "--signal", "SIGKILL", "--all", task)

    def _kill_leftover_shims(self) -> None:
        """Shims (and their containers) whose containerd was ours: they name its socket address."""
        needle = str(self.containerd_socket).encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmd and needle in cmd:
                try:
                    os.killpg(int(proc.name), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _remove_cgroups(self) -> None:
        for hierarchy in _v1_hierarchies():
            top = hierarchy / self.cgroup_root.lstrip("/")
            if not top.is_dir():
                continue
            for deadline in (time.monotonic() + 10,):
                while top.exists() and time.monotonic() < deadline:
                    for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [top]:
                        try:
                            d.rmdir()
                        except OSError:
                            pass
                    if top.exists():
                        time.sleep(0.2)

    # ---- facts for ansible -------------------------------------------------------------------
    def inventory_vars(self) -> dict[str, Any]:
        """Everything inventories/local-cluster needs that only exists once the cluster is up."""
        self._webhook_client()  # idempotent: the CA the webhook's --client-ca-file names
        return {
            "qgpu_kubeconfig": str(self.admin_kubeconfig),
            "qgpu_local_cluster_dir": str(self.dir),
            "qgpu_local_cluster_containerd_address": str(self.containerd_socket),
            "qgpu_local_cluster_ctr": str(self.containerd_bin / "ctr"),
            "qgpu_kube_apiserver_host": "127.0.0.1",
            "qgpu_kube_apiserver_port": self.state.ports["apiserver"],
            "qgpu_local_cluster_manifests": str(self.dir / "manifests"),
            "qgpu_local_cluster_scheduler_kubeconfig": str(self.dir / "scheduler.kubeconfig"),
            "qgpu_local_cluster_scheduler_port": self.port("scheduler"),
            "qgpu_local_cluster_extender_port": self.port("extender"),
            "qgpu_local_cluster_webhook_port": self.port("webhook"),
            "qgpu_local_cluster_webhook_client_ca_pem": (self.pki / "webhook-client" / "ca.crt").read_text(),
            "qgpu_local_cluster_metrics_port": self.port("manager-metrics"),
            "qgpu_local_cluster_kubelet_root": str(self.dir / "host" / "kubelet"),
            # the pods of a failed card evicted unless they tolerate it (tests/realnode/test_e2e_card_failure.py);
            # a DRA pool has its device taints instead
            **(self._dra_vars() if self.dra else {"qgpu_scheduler_evict_unhealthy_cards": True}),
        }

    def _dra_vars(self) -> dict[str, Any]:
        """The pool in DRA mode (roles' ``qgpu_pool_mode``): DeviceClasses, the manager serving the
        kubelet plugin and the node's ResourceSlice. The node pool role checks containerd's version
        with this cluster's binary; the containerd config itself is this script's (CDI already on)."""
        return {
            "qgpu_pool_mode": "dra",
            "qgpu_node_pool_containerd_binary": str(self.containerd_bin / "containerd"),
            "qgpu_node_pool_manage_services": False,
            # The webhook's DRA conversion of T9k percent requests needs the pool's card sizes.
            "qgpu_webhook_dra_card_memory_mib": sorted({int(c["memory_mib"]) for c in self.simulated_cards}),
            # An unhealthy card's pods evicted by kube-controller-manager: the operator's option,
            # shown on the real node (tests/realnode/test_e2e_dra.py)
            "qgpu_manager_dra_unhealthy_effect": "NoExecute",
        }


def _v1_hierarchies() -> list[Path]:
    if not CGROUP_V1.is_dir():
        return []
    # Every mounted hierarchy, the hybrid layout's "unified" one included: the kubelet makes its
    # cgroup root in each.
    return [p for p in CGROUP_V1.iterdir() if p.is_dir() and (p / "cgroup.procs").exists()]


def _containerd_config(root: Path, cni_bin: Path, cni_conf: Path, cdi: tuple[Path, ...]) -> str:
    cdi_dirs = ", ".join(f"'{d}'" for d in cdi)
    return f"""# written by tests/realnode/localcluster.py
version = 3
root = "{root / 'root'}"
state = "{root / 'state'}"
[grpc]
  address = "{root / 'containerd.sock'}"
[ttrpc]
  address = "{root / 'containerd.sock.ttrpc'}"
[debug]
  address = ""
[metrics]
  address = ""
[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{PAUSE_IMAGE}'
  [plugins.'io.containerd.cri.v1.runtime']
    # These machines lack CAP_SYS_RESOURCE: runc cannot give the pause process its -998 OOM score.
    restrict_oom_score_adj = true
    # The DRA kubelet plugin names CDI devices; containerd resolves them from these folders.
    enable_cdi = true
    cdi_spec_dirs = [{cdi_dirs}]
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{cni_bin}']
      conf_dir = '{cni_conf}'
"""


def _bin(script: str, *args: str) -> Path:
    out = subprocess.run([str(ROOT / "scripts" / script), *args], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="local-cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--dra", action="store_true",
                        help="up: the GPU pool in DRA mode (kept by later `up`s until `down`)")
    parser.add_argument("--dir", type=Path, default=ROOT / ".cache" / "local-cluster" / "cluster",
                        help="where the cluster lives (default: .cache/local-cluster/cluster)")
    args = parser.parse_args(argv)
    say = lambda msg: print(f"local-cluster: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if args.action == "down":
        if not (args.dir / "state.json").exists():
            say(f"nothing to stop in {args.dir}")
            return 0
        cluster = LocalCluster(args.dir, Path("/nonexistent"), _bin("containerd-bin", "--print-dir"), log=say)
        cluster.down()
        return 0
    k8s_bin = _bin("k8s-testbin")
    containerd_bin = _bin("containerd-bin")
    cluster = LocalCluster(args.dir, k8s_bin, containerd_bin, log=say, dra=True if args.dra else None)
    if args.action == "status":
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "mountns", "containerd", "kubelet"):
            say(f"{name}: {'running' if cluster.running(name) else 'stopped'}")
        say(f"GPU pool mode: {'dra' if cluster.dra else 'device-plugin'}")
        return 0
    try:
        cluster.up()
    except ClusterError as exc:
        say(str(exc))
        return 1
    (args.dir / "inventory-vars.yml").write_text(yaml.safe_dump(cluster.inventory_vars(), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
