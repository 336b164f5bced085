"""The masters' upgrade on the real node (issue 26 §2): kube-scheduler's static pod manifest is
replaced as `kubeadm upgrade apply` replaces it (a new image tag, kubeadm's own flags, none of
qgpu's wiring, written by rename), and the re-wiring watcher the role installed — run exactly as its
systemd unit says — puts the wiring back, records an Event on the Node with an identity that can do
nothing else, and a GPU pod created right after is placed by qgpu's extender."""

from __future__ import annotations

import json
import os
import shlex
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from qgpu_runtime.contract.names import ALLOCATION
from qgpu_runtime.contract.record import parse_record
from qgpu_runtime.wiring import formats
from tests.polling import poll
from tests.realnode import kube
from tests.realnode.localcluster import LocalCluster
from tests.realnode.test_e2e_dialects import cluster_image, delete

CORE = "tke.cloud.tencent.com/qgpu-core"
MEMORY = "tke.cloud.tencent.com/qgpu-memory"

ns = kube.namespace_fixture("rewire")


def unit_argv(cluster: LocalCluster) -> list[str]:
    """The ExecStart of the unit the kube_scheduler_extender role wrote for this master."""
    unit = (cluster.dir / "systemd" / "qgpu-scheduler-wiring.service").read_text()
    (line,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


def write_by_rename(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.parent.parent / f".{path.name}.upgrade"
    tmp.write_text(yaml.safe_dump(doc))
    os.replace(tmp, path)


def scheduler_healthy(cluster: LocalCluster) -> bool:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        return cluster._https_ok(f"https://127.0.0.1:{cluster.port('scheduler')}/healthz", ctx)
    except OSError:  # refused while kubelet restarts it
        return False


@pytest.fixture
def watcher(local_cluster: LocalCluster, tmp_path: Path) -> Iterator[tuple[list[str], Path]]:
    """The watcher running as its unit runs it; afterwards the manifest and the role's state as they were."""
    argv = unit_argv(local_cluster)
    state_path = Path(argv[argv.index("--state") + 1])
    state = json.loads(state_path.read_text())
    manifest_path = Path(state["root"] + state["manifest"])
    saved = manifest_path.read_text(), state_path.read_text()
    log = tmp_path / "watcher.log"
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        poll(lambda: "watching the kube-scheduler manifest" in log.read_text() or proc.poll() is not None,
             timeout=30, what="the watcher started")
        assert proc.poll() is None, log.read_text()
        yield argv, log
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if manifest_path.read_text() != saved[0]:
            write_by_rename(manifest_path, yaml.safe_load(saved[0]))
        state_path.write_text(saved[1])
        time.sleep(3)  # kubelet sees the manifest change and restarts kube-scheduler
        poll(lambda: scheduler_healthy(local_cluster), timeout=120, what="kube-scheduler healthy again")


def test_an_upgrade_that_rewrites_the_manifest_is_rewired_and_gpu_pods_are_placed_by_qgpu(
        local_cluster: LocalCluster, ns: str, watcher: tuple[list[str], Path]) -> None:
    cluster = local_cluster
    argv, log = watcher
    assert "--kubeconfig" in argv, "the role passed the watcher no Events identity (qgpu_scheduler_wiring_token)"
    state = json.loads(Path(argv[argv.index("--state") + 1]).read_text())
    manifest_path = Path(state["root"] + state["manifest"])
    wired = yaml.safe_load(manifest_path.read_text())
    assert formats.scheduler_is_wired(wired, state["format"], state["config_file"], state["config_dir"])

    # the upgrade: a new patch release of kube-scheduler (the same binary under a new tag) in a manifest
    # kubeadm regenerated — its flags, no qgpu flags, mount or checksum — written by rename
    old_ref = wired["spec"]["containers"][0]["image"]
    old_version = formats.scheduler_version_from_manifest(wired)
    major, minor, patch = (int(part) for part in old_version.split("."))
    new_version = f"{major}.{minor}.{patch + 1}"
    new_ref = f"{old_ref.rsplit(':', 1)[0]}:v{new_version}"
    if not cluster.image_present(new_ref):
        cluster.ctr("images", "tag", old_ref, new_ref)
    upgraded = formats.scheduler_unwire(wired, state["config_dir"])
    upgraded["spec"]["containers"][0]["image"] = new_ref
    assert not formats.scheduler_is_wired(upgraded, state["format"], state["config_file"], state["config_dir"])
    started = time.monotonic()
    write_by_rename(manifest_path, upgraded)

    def rewired() -> dict[str, Any] | None:
        doc = yaml.safe_load(manifest_path.read_text())
        ok = (doc["spec"]["containers"][0]["image"] == new_ref
              and formats.scheduler_is_wired(doc, state["format"], state["config_file"], state["config_dir"]))
        return doc if ok else None

    doc = poll(rewired, timeout=30, interval=0.2, what=f"the manifest re-wired (watcher log: {log})")
    elapsed = time.monotonic() - started
    assert doc["metadata"]["annotations"][formats.CHECKSUM_ANNOTATION] == state["restart_sha256"]
    after = json.loads(Path(argv[argv.index("--state") + 1]).read_text())
    assert after["kubernetes_version"] == new_version and after["format"] == state["format"]
    assert f"kube-scheduler upgraded from {old_version} to {new_version}" in after["healed"]["what"]
    print(f"re-wired {elapsed:.1f} s after the upgraded manifest was written")

    api = kube.core(cluster)

    def rewired_event() -> Any:
        events = api.list_namespaced_event("default", field_selector="involvedObject.kind=Node,involvedObject.name=localhost").items
        return [e for e in events if e.reason == "SchedulerRewired" and new_version in (e.message or "")] or None

    (event,) = poll(rewired_event, timeout=30, what="the SchedulerRewired Event on node localhost")
    assert event.type == "Normal" and event.source.component == "qgpu-scheduler-wiring"

    # the watcher's identity may record Events and nothing else
    kubeconfig = argv[argv.index("--kubeconfig") + 1]
    assert oct(os.stat(kubeconfig).st_mode & 0o777) == "0o600"
    own = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
    for what, call in (("list pods", lambda: own.list_namespaced_pod("default")),
                       ("read the node", lambda: own.read_node("localhost")),
                       ("create an Event in kube-system", lambda: own.create_namespaced_event("kube-system", {
                           "metadata": {"generateName": "x."}, "involvedObject": {"kind": "Node", "name": "localhost"},
                           "reason": "Forged", "message": "m", "type": "Normal"}))):
        with pytest.raises(ApiException) as denied:
            call()
        assert denied.value.status == 403, what

    # kube-scheduler restarted on the re-wired manifest; a GPU pod created now is placed by qgpu
    poll(lambda: scheduler_healthy(cluster), timeout=120, what="kube-scheduler healthy on the re-wired manifest")
    api.create_namespaced_pod(ns, kube.shell_pod("after-upgrade", cluster_image(cluster), "sleep 3600",
                                                 limits={CORE: "30", MEMORY: "4"}))
    pod = kube.wait_phase(api, ns, "after-upgrade", ("Running",), timeout=120)
    record = parse_record(pod["metadata"]["annotations"][ALLOCATION])
    assert [share.core_milli for share in record.containers[0].shares] == [300]
    delete(cluster, ns, "after-upgrade")
