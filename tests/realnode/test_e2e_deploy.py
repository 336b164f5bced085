"""site.yml on a real node: every qgpu component runs as a pod of the image qgpu_image built (its
digest in the pod template), the node advertises every dialect, kube-scheduler (a static pod) is wired to the extender, and a second
run changes nothing."""

from __future__ import annotations

import re

import yaml

from qgpu_runtime.contract.names import IMAGE_DIGEST
from tests.realnode import kube
from tests.realnode.conftest import site_yml
from tests.realnode.localcluster import QGPU_NAMESPACE, LocalCluster

COMPONENTS = ("qgpu-manager", "qgpu-scheduler", "qgpu-webhook")


def qgpu_pods(cluster: LocalCluster) -> list[dict]:
    api = kube.core(cluster)
    out = api.list_namespaced_pod(QGPU_NAMESPACE, label_selector="app.kubernetes.io/part-of=qgpu")
    return [api.api_client.sanitize_for_serialization(p) for p in out.items]


def test_every_component_runs_as_a_ready_pod_of_the_built_image(local_cluster: LocalCluster) -> None:
    pods = qgpu_pods(local_cluster)
    names = {p["metadata"]["labels"]["app.kubernetes.io/name"] for p in pods}
    assert names == set(COMPONENTS)
    for pod in pods:
        ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert pod["status"]["phase"] == "Running" and ready["Ready"] == "True", pod["metadata"]["name"]
        (image,) = {c["image"] for c in pod["spec"]["containers"]}
        # Imported into the node's containerd by site.yml, never pulled.
        assert local_cluster.image_present(image), image
        assert pod["spec"]["containers"][0]["imagePullPolicy"] == "Never"
        # ... and its digest in the pod template, so that a rebuilt image rolls the pods
        assert pod["metadata"]["annotations"][IMAGE_DIGEST] == image_digest(local_cluster, image)


def image_digest(cluster: LocalCluster, ref: str) -> str:
    """The manifest digest containerd holds for ``ref``."""
    rows = [line.split() for line in cluster.ctr("images", "list", f"name=={ref}").stdout.decode().splitlines()[1:]]
    (digest,) = {row[2] for row in rows if row and row[0] == ref}
    return digest


def test_the_node_advertises_every_dialect_with_its_unit_counts(local_cluster: LocalCluster) -> None:
    api = kube.core(local_cluster)
    # 2 simulated V100 32 GiB cards. The manager's device plugins register with the real kubelet.
    # nvidia.com/gpu counts GiB (one device per share a card can take: HAMi's and KAI's shares
    # reach the kubelet under that name; docs/node-manager.md, "Resources").
    want = {"tke.cloud.tencent.com/qgpu-core": "200", "tke.cloud.tencent.com/qgpu-memory": "64",
            "tke.cloud.tencent.com/qgpu-core-greedy": "200", "tencent.com/vcuda-core": "200",
            "tencent.com/vcuda-memory": "256", "tensorstack.dev/nvidia-gpu": "2",
            "tensorstack.dev/nvidia-gpu-percent": "200", "tensorstack.dev/nvidia-gpu-node": "1",
            "nvidia.com/gpu": "64"}
    have = kube.poll_allocatable(api, want)
    assert {k: have.get(k) for k in want} == want


def test_kube_scheduler_static_pod_reads_the_extender_config_the_role_wrote(local_cluster: LocalCluster) -> None:
    manifest = yaml.safe_load((local_cluster.dir / "manifests" / "kube-scheduler.yaml").read_text())
    container = manifest["spec"]["containers"][0]
    argv = container.get("command", []) + container.get("args", [])
    config = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
    extenders = yaml.safe_load(open(config))["extenders"]
    assert [e["urlPrefix"] for e in extenders] == [f"http://127.0.0.1:{local_cluster.port('extender')}"]
    api = kube.core(local_cluster)
    mirror = kube.read(api, "kube-system", "kube-scheduler-localhost")
    assert mirror["status"]["phase"] == "Running"
    running = mirror["spec"]["containers"][0]
    assert any(a.startswith("--config=") for a in running.get("command", []) + running.get("args", []))


def test_a_second_site_yml_changes_nothing(local_cluster: LocalCluster) -> None:
    out = site_yml(local_cluster)
    assert out.returncode == 0, out.stdout[-4000:]
    recap = re.findall(r"^(\S+)\s+: ok=\d+\s+changed=(\d+)", out.stdout, re.M)
    assert recap and all(changed == "0" for _, changed in recap), changed_tasks(out.stdout)


def changed_tasks(output: str) -> list[str]:
    """The TASK headers followed by a 'changed:' line in ansible-playbook's output."""
    tasks, current = [], ""
    for line in output.splitlines():
        if line.startswith("TASK ["):
            current = line.rstrip("* ")
        elif line.startswith("changed:"):
            tasks.append(f"{current} -> {line}")
    return tasks
