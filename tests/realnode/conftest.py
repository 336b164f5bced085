"""The real node: one cluster for all of tests/realnode (one worker runs them all:
docs/testing.md#workers), brought up exactly as ``scripts/local-cluster up``
does (tests/realnode/localcluster.py) and provisioned by site.yml through inventories/local-cluster
with rollout waits on, so qgpu's extender, webhook and node manager run as pods from the image the
qgpu_image role builds. Torn down at the end, leaving the host as it was."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from tests.realnode.localcluster import KUBELET_SYSCTLS, QGPU_NAMESPACE, ROOT, LocalCluster

# No `pytestmark` here: pytest reads it from test modules only. tests/conftest.py marks every test
# of this directory `realnode` (and `slow`).


def _run(*argv: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=True, text=True, **kwargs)  # type: ignore[call-overload]


def _bin(script: str) -> Path:
    out = _run(str(ROOT / "scripts" / script), stdout=subprocess.PIPE)
    return Path(out.stdout.strip().splitlines()[-1])


def site_yml(cluster: LocalCluster, *extra: str) -> subprocess.CompletedProcess[str]:
    """site.yml against the cluster, as `scripts/local-cluster up` runs it; output kept for asserts."""
    vars_file = cluster.dir / "inventory-vars.yml"
    vars_file.write_text(yaml.safe_dump(cluster.inventory_vars()))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0"}
    out = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(ROOT / "inventories" / "local-cluster"),
                          "-e", f"@{vars_file}", *extra, str(ROOT / "playbooks" / "site.yml")],
                         cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    (cluster.logs / "site-yml.log").open("a").write(out.stdout)
    return out


def running_cluster(env: str, prefix: str, dra: bool = False) -> Iterator[LocalCluster]:
    """A fresh local cluster with site.yml applied (its GPU pool in DRA mode with ``dra``), torn
    down afterwards and checked to leave the host as it found it; with ``env``=<dir> set, a cluster
    `scripts/local-cluster up` already runs there (kept afterwards; quick iterations)."""
    if os.geteuid() != 0:
        pytest.skip("the real node needs root: containerd, the kubelet, mounts and cgroups")
    _run(str(ROOT / "scripts" / "local-cluster-deps"))
    existing = os.environ.get(env)
    if existing:
        cluster = LocalCluster(Path(existing), _bin("k8s-testbin"), _bin("containerd-bin"))
        cluster.first_site_yml = ""  # type: ignore[attr-defined]
        yield cluster
        return
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    cluster = LocalCluster(workdir, _bin("k8s-testbin"), _bin("containerd-bin"), persistent=False, dra=dra,
                           log=lambda msg: print(f"local-cluster: {msg}", file=sys.stderr, flush=True))
    before = host_state(workdir)
    try:
        cluster.up()
        out = site_yml(cluster)
        if out.returncode != 0:
            raise AssertionError(f"site.yml failed on the local cluster{' in DRA mode' if dra else ''}:\n{out.stdout[-6000:]}\n"
                                 f"{qgpu_namespace_state(cluster)}")
        cluster.first_site_yml = out.stdout  # type: ignore[attr-defined]
        yield cluster
    finally:
        cluster.down()
    # `down` leaves the host as it found it: a leak fails the session here.
    assert host_state(workdir) == before


@pytest.fixture(scope="package")
def local_cluster() -> Iterator[LocalCluster]:
    """The cluster of tests/realnode, torn down right after its last test (its kubelet, containerd
    and control plane would otherwise load the machine for the rest of the run);
    QGPU_REALNODE_CLUSTER=<dir> reuses one."""
    yield from running_cluster("QGPU_REALNODE_CLUSTER", "qgpu-realnode-")


def host_state(workdir: Path) -> dict[str, object]:
    """What a cluster could leave behind on the host: sysctls the kubelet sets, cgroups, mounts and
    processes naming the cluster's directory."""
    procs = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(workdir).encode() in (proc / "cmdline").read_bytes():
                    procs.append(proc.name)
            except OSError:
                pass
    return {
        "sysctls": {k: Path("/proc/sys", *k.split(".")).read_text().strip() for k in KUBELET_SYSCTLS},
        "cgroups": sorted(str(p) for p in Path("/sys/fs/cgroup").glob("*/qgpu-*")),
        "mounts": [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(workdir) in line],
        "processes": procs,
        "var_lib_kubelet": Path("/var/lib/kubelet").exists(),
    }


def qgpu_namespace_state(cluster: LocalCluster) -> str:
    """What a failed rollout leaves to read: qgpu's workloads, their pods and the namespace's Warning
    Events (a pod its controller could not create shows only there)."""
    from tests.realnode import kube
    try:
        api = kube.core(cluster)
        lines = ["qgpu namespace:"]
        for pod in api.list_namespaced_pod(QGPU_NAMESPACE).items:
            states = [f"{c.name}: ready={c.ready} restarts={c.restart_count} {c.state.waiting or c.state.terminated or ''}"
                      for c in pod.status.container_statuses or []]
            lines.append(f"  pod {pod.metadata.name} {pod.status.phase} {states}")
            for c in pod.status.container_statuses or []:
                if not c.ready:  # why it is not Ready is usually in its last lines
                    try:
                        tail = api.read_namespaced_pod_log(pod.metadata.name, QGPU_NAMESPACE, container=c.name, tail_lines=25)
                    except Exception as exc:  # noqa: BLE001
                        tail = f"(log not readable: {exc})"
                    lines.extend(f"    {line}" for line in str(tail).splitlines())
        for event in api.list_namespaced_event(QGPU_NAMESPACE).items:
            if event.type == "Warning":
                lines.append(f"  {event.involved_object.kind}/{event.involved_object.name} {event.reason}: {event.message}")
        return "\n".join(lines)[-12000:]
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not hide the failure it explains
        return f"(qgpu namespace not readable: {exc})"
