"""The roles name the labels, annotations and taints the runtime reads, spelled as contract/names.py
spells them: a role that labels a pool with a name the runtime does not know is caught here."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from qgpu_runtime.contract import dra, names
from qgpu_runtime.model.requests import GPU_RESOURCES, KAI_ANNOTATIONS, QGPU_PREFIX
from qgpu_runtime.webhook.podquota import CHARGE_ANNOTATIONS

ROOT = Path(__file__).resolve().parents[2]
PROVISIONING = [p for d in ("roles", "templates", "playbooks", "inventories") for p in (ROOT / d).rglob("*")
                if p.is_file() and p.suffix in {".yml", ".yaml", ".j2", ".json"}]
# qgpu.io and its subdomains (rollout.qgpu.io, the DRA driver's gpu.qgpu.io), each name whole
NAME = re.compile(r"\b(?:(?:[a-z0-9-]+\.)*qgpu\.io|sched\.tensorstack\.dev|tke\.cloud\.tencent\.com)/[a-z0-9][a-z0-9.-]*[a-z0-9]"
                  r"|\b(?:mixed-qgpu-enable|qgpu-device-enable)\b")


def _named() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in PROVISIONING:
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_name_the_roles_write_is_one_the_contract_knows():
    # the dialects' resource names belong to model/requests.py; the roles also name their prefix
    known = names.SHARED | set(GPU_RESOURCES) | set(CHARGE_ANNOTATIONS) | {"tke.cloud.tencent.com/qgpu", dra.UNHEALTHY_TAINT}
    unknown = {n: sorted(where) for n, where in _named().items() if n not in known}
    assert not unknown, f"names in the roles that qgpu_runtime/contract/names.py does not define: {unknown}"


def test_the_roles_apply_the_pool_labels_the_runtime_reads():
    found = _named()
    for name in (names.ISOLATION_POLICY_LABEL, names.MIXED_LABEL, names.ALLOC_MODE_LABEL, names.ACCELERATOR_LABEL,
                 names.DEVICE_ENABLE_LABEL, names.XGN_TAINT_KEY, names.POOL_MODE_LABEL):
        assert any(w.startswith("roles/qgpu_node_pool/") for w in found.get(name, ())), f"qgpu_node_pool never names {name}"


def test_the_xgn_taint_the_role_applies_is_the_one_the_webhook_tolerates():
    from qgpu_runtime.webhook.admission import XGN_TOLERATION

    defaults = yaml.safe_load((ROOT / "roles/qgpu_node_pool/defaults/main.yml").read_text())
    taint = defaults["qgpu_node_pool_xgn_taint"]
    assert (taint["key"], taint["value"], taint["effect"]) == (XGN_TOLERATION["key"], XGN_TOLERATION["value"], XGN_TOLERATION["effect"])
    assert taint["key"] == names.XGN_TAINT_KEY


def test_the_check_would_catch_a_misspelt_label(tmp_path):
    assert NAME.findall("labels: {qgpu.io/gpu-modle: x}") == ["qgpu.io/gpu-modle"]
    assert NAME.findall("annotations: {rollout.qgpu.io/image-digset: x}") == ["rollout.qgpu.io/image-digset"]
    assert "qgpu.io/gpu-modle" not in names.SHARED


def test_the_pod_annotation_policy_leaves_open_only_what_users_and_pod_templates_write():
    """qgpu-pod-annotations (roles/qgpu_scheduler): every qgpu.io/ pod annotation qgpu acts on is
    closed to tenants; what users write themselves and the roles' pod-template checksums (written
    by the DaemonSet and Deployment controllers) stay open, or qgpu's own pods could not start."""
    defaults = yaml.safe_load((ROOT / "roles/qgpu_scheduler/defaults/main.yml").read_text())
    open_ = set(defaults["qgpu_scheduler_open_pod_annotations"])
    assert open_ == {names.LABEL_GPU_MODEL, names.GPU_MODE, names.GROUP_MIN_MEMBER, *names.POD_TEMPLATE_ANNOTATIONS}
    assert not open_ & {names.ALLOCATION, names.BIND_TIME, names.ALLOCATION_SIGNATURE, names.ASSIGNED}


def test_the_request_annotation_policy_fixes_exactly_what_a_pods_charge_is_read_from():
    """qgpu-pod-request-annotations (roles/qgpu_scheduler): the annotations the request parser and
    the pod quota read (webhook/podquota.py CHARGE_ANNOTATIONS) are the ones fixed after CREATE; an
    annotation the parser starts reading must join the policy, or a tenant re-charges its pods."""
    role = yaml.safe_load((ROOT / "roles/qgpu_scheduler/vars/main.yml").read_text())
    fixed = role["__qgpu_scheduler_request_annotations"] + role["__qgpu_scheduler_kai_request_annotations"]
    assert sorted(fixed) == sorted(CHARGE_ANNOTATIONS) and len(fixed) == len(set(fixed))
    # KAI's keys are fixed only on KAI's pods, the only ones the parser reads them on
    assert sorted(role["__qgpu_scheduler_kai_request_annotations"]) == sorted(KAI_ANNOTATIONS)


def test_the_bound_pod_policy_knows_every_gpu_resource_the_parser_reads() -> None:
    """The admission policy qgpu-pod-placed-by-extender refuses a pod created already bound when it
    asks for a GPU resource: a resource the parser reads and the list lacks would let such a pod past
    the extender and its record (its Allocate then matched to another pod's)."""
    role = yaml.safe_load((ROOT / "roles/qgpu_scheduler/vars/main.yml").read_text())
    listed = role["__qgpu_scheduler_gpu_resources"]
    assert sorted(listed) == sorted(GPU_RESOURCES) and len(listed) == len(set(listed))
    assert role["__qgpu_scheduler_gpu_resource_prefix"] == QGPU_PREFIX
