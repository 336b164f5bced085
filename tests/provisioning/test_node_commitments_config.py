"""Two active binders need node commitments (issue 11 §5): what the roles render and refuse.

kube_scheduler_extender keeps kube-scheduler's leader election on by default and refuses, before
any change, leader election off with several schedulers while node commitments are off.
qgpu_scheduler turns commitments on by default and grants the extender exactly the Lease verbs
they need, in its own namespace.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import yaml
from ansible_tools import REPO, ansible_playbook

VERSION = "1.25.16"


def render_masters(sandbox: Path, **variables: object):
    return ansible_playbook("-i", "localhost,", str(REPO / "tests/provisioning/playbooks/render-scheduler-configs.yml"),
                            "-e", json.dumps({"sandbox": str(sandbox), "versions": [VERSION], **variables}))


def test_leader_election_is_on_by_default(tmp_path: Path) -> None:
    run = render_masters(tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    config = yaml.safe_load((tmp_path / VERSION / "etc/kubernetes/qgpu/kube-scheduler-config.yaml").read_text())
    assert config["leaderElection"]["leaderElect"] is True


def test_leader_election_off_with_two_schedulers_and_no_commitments_is_refused_before_any_change(tmp_path: Path) -> None:
    run = render_masters(tmp_path, kube_scheduler_extender_leader_elect=False, kube_scheduler_extender_schedulers=2,
                         kube_scheduler_extender_node_commitments=False)
    assert run.returncode != 0
    assert "2 kube-schedulers would bind at once" in run.output, run.output[-4000:]
    assert not (tmp_path / VERSION / "etc/kubernetes/qgpu").exists()  # nothing written


def test_leader_election_off_with_two_schedulers_is_accepted_with_commitments(tmp_path: Path) -> None:
    run = render_masters(tmp_path, kube_scheduler_extender_leader_elect=False, kube_scheduler_extender_schedulers=2,
                         qgpu_scheduler_node_commitments=True)
    assert run.returncode == 0, run.output[-4000:]
    config = yaml.safe_load((tmp_path / VERSION / "etc/kubernetes/qgpu/kube-scheduler-config.yaml").read_text())
    assert config["leaderElection"]["leaderElect"] is False


def ansible_bool(value: object) -> bool:
    """Ansible's ``bool`` filter for the values an inventory gives."""
    return value is True or str(value).strip().lower() in ("yes", "on", "1", "true", "y", "t")


def render_extender(**overrides: object) -> list[dict]:
    defaults = yaml.safe_load((REPO / "roles/qgpu_scheduler/defaults/main.yml").read_text())
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(REPO / "templates/kubernetes")),
                             undefined=jinja2.StrictUndefined)
    env.filters["to_json"] = json.dumps
    env.filters["bool"] = ansible_bool
    fixed = yaml.safe_load((REPO / "roles/qgpu_scheduler/vars/main.yml").read_text())  # names shared with the runtime
    variables = {**defaults, "__qgpu_scheduler_request_annotations": fixed["__qgpu_scheduler_request_annotations"],
                 "__qgpu_scheduler_kai_request_annotations": fixed["__qgpu_scheduler_kai_request_annotations"],
                 "__qgpu_scheduler_gpu_resources": fixed["__qgpu_scheduler_gpu_resources"],
                 "__qgpu_scheduler_gpu_resource_prefix": fixed["__qgpu_scheduler_gpu_resource_prefix"],
                 "__qgpu_scheduler_largest_card_memory_mib": 81920,  # vars/main.yml's default, an Ansible expression there
                 "qgpu_scheduler_namespace": "qgpu-system", "qgpu_scheduler_image": "qgpu:test",
                 "qgpu_scheduler_kube_apiserver_host": "", **overrides}
    text = env.get_template("qgpu-scheduler.yaml.j2").render(ansible_managed="test", **variables)
    return [d for d in yaml.safe_load_all(text) if d]


def test_commitments_are_on_by_default_with_a_namespaced_role_for_leases_only() -> None:
    docs = render_extender()
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    args = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--node-commitments" in args and "--commitment-namespace=qgpu-system" in args
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "qgpu-system"
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "create", "update"]}]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "qgpu-scheduler", "namespace": "qgpu-system"}]
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert all("leases" not in rule["resources"] for rule in cluster_role["rules"])


def test_commitments_off_renders_no_lease_role_and_says_so_to_the_extender() -> None:
    docs = render_extender(qgpu_scheduler_node_commitments=False)
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    assert "--no-node-commitments" in daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
