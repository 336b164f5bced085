"""qgpu's own upgrade on the real node (issue 26 §3): GPU pods of three dialects run, then site.yml
builds the image again from a changed source (another source fingerprint, as a new checkout gives)
and rolls every qgpu component to it. The managers, extender and webhook are new pods of the new
image; no GPU pod restarts, each keeps its share in the node's store, its allocation record and its
card, and the store keeps its schema (docs/operations.md, "Upgrading qgpu"). Then the rollback:
site.yml from the original source builds the original digest again (reproducible builds) and rolls
every component back to it, and again no GPU pod notices."""

from __future__ import annotations

import hashlib
import re
import sqlite3
import time
from pathlib import Path

from qgpu_runtime.contract.names import ALLOCATION, IMAGE_DIGEST
from qgpu_runtime.contract.store import SCHEMA_VERSION, file_version
from tests.realnode import kube
from tests.realnode.conftest import qgpu_namespace_state, site_yml
from tests.realnode.localcluster import LocalCluster
from tests.realnode.test_e2e_deploy import image_digest, qgpu_pods
from tests.realnode.test_e2e_dialects import delete
from tests.realnode.test_e2e_restarts import store_shares

ns = kube.namespace_fixture("upgrade")

PODS = {  # one pod of each dialect family the device plugin serves
    "qgpu": {"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "4"},
    "vcuda": {"tencent.com/vcuda-core": "20", "tencent.com/vcuda-memory": "8"},
    "whole": {"nvidia.com/gpu": "1"},
}
ROOT = Path(__file__).resolve().parents[2]


def changed_source() -> str:
    """A source fingerprint other than the checkout's, as another checkout gives, yet one that follows
    this checkout's source: the roles cache wheels and image layers per fingerprint, so a constant
    one would reuse a wheel built from whatever source ran the test first (a later run then rolled
    out an older extender)."""
    digest = hashlib.sha256(b"qgpu upgrade test: another checkout\n")
    for path in sorted([*(ROOT / "qgpu_runtime").rglob("*"), ROOT / "pyproject.toml"]):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def store_schema(cluster: LocalCluster) -> int | None:
    """The node store's schema version (contract/store.py ``meta.schema_version``), read-only."""
    db = sqlite3.connect(f"file:{cluster.dir / 'host' / 'qgpu' / 'meta.db'}?mode=ro", uri=True)
    try:
        return file_version(db)
    finally:
        db.close()


def rolled(cluster: LocalCluster, previous: set[str], digest: str) -> set[str]:
    """Every qgpu component is a new pod (none of ``previous``), Ready, of ``digest``; their UIDs."""
    pods = qgpu_pods(cluster)
    assert not previous & {p["metadata"]["uid"] for p in pods}
    for pod in pods:
        ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert ready["Ready"] == "True" and pod["metadata"]["annotations"][IMAGE_DIGEST] == digest
    return {p["metadata"]["uid"] for p in pods}


def untouched(cluster: LocalCluster, ns: str, before: dict[str, dict], shares: dict) -> None:
    """The GPU pods: same containers, never restarted, same record; the node's shares and schema kept."""
    api = kube.core(cluster)
    for name, was in before.items():
        now = kube.read(api, ns, name)
        assert now["status"]["phase"] == "Running", name
        (status,) = now["status"]["containerStatuses"]
        assert status["containerID"] == was["status"]["containerStatuses"][0]["containerID"] and status["restartCount"] == 0
        assert now["metadata"]["annotations"][ALLOCATION] == was["metadata"]["annotations"][ALLOCATION]
    assert store_shares(cluster) == shares and store_schema(cluster) == SCHEMA_VERSION


def test_a_rebuilt_image_rolls_every_component_and_no_gpu_pod_notices(local_cluster: LocalCluster, ns: str) -> None:
    cluster = local_cluster
    api = kube.core(cluster)
    image = qgpu_pods(cluster)[0]["spec"]["containers"][0]["image"]
    for name, limits in PODS.items():
        api.create_namespaced_pod(ns, kube.shell_pod(name, image, "exec sleep 3600", limits=limits))
    before = {name: kube.wait_phase(api, ns, name, ("Running",)) for name in PODS}
    shares, schema = store_shares(cluster), store_schema(cluster)
    components = {p["metadata"]["uid"] for p in qgpu_pods(cluster)}
    old_digest = image_digest(cluster, image)

    started = time.monotonic()
    out = site_yml(cluster, "-e", f"qgpu_runtime_fingerprint={changed_source()}")
    assert out.returncode == 0, f"{out.stdout[-6000:]}\n{qgpu_namespace_state(cluster)}"
    print(f"site.yml with a rebuilt image: {time.monotonic() - started:.0f} s", flush=True)

    new_digest = image_digest(cluster, image)
    assert new_digest != old_digest
    # every component a new pod, Ready, of the new image's digest (the rollout waited for them)
    upgraded = rolled(cluster, components, new_digest)
    untouched(cluster, ns, before, shares)
    assert schema == SCHEMA_VERSION
    changed = re.findall(r"^changed: .*$", out.stdout, re.M)
    assert changed, "a rebuilt image changes the image and the rollouts"

    # rollback: site.yml from the previous source (its own fingerprint) brings the previous digest back
    started = time.monotonic()
    out = site_yml(cluster)
    assert out.returncode == 0, f"{out.stdout[-6000:]}\n{qgpu_namespace_state(cluster)}"
    print(f"site.yml rolling back to the previous image: {time.monotonic() - started:.0f} s", flush=True)
    assert image_digest(cluster, image) == old_digest
    rolled(cluster, upgraded, old_digest)
    untouched(cluster, ns, before, shares)
    for name in PODS:
        delete(cluster, ns, name)
