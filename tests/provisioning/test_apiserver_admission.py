"""kube_apiserver_admission: the admission configuration that makes kube-apiserver present its
client certificate to the qgpu webhook, in the format of each supported Kubernetes version, with
the webhook's exact user names, wired into kubeadm's static pod (issue 21 §2).

The v1 format is the one tests/k8s/controlplane.py gives the real kube-apiserver v1.37
(tests/k8s/test_e2e_webhook_auth.py proves the certificate arrives)."""

from __future__ import annotations

import importlib.util
import json
import stat
import sys
from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible_tools import REPO, ansible_playbook

_spec = importlib.util.spec_from_file_location(
    "apiserver_admission", REPO / "roles/kube_apiserver_admission/filter_plugins/apiserver_admission.py")
assert _spec and _spec.loader
admission = importlib.util.module_from_spec(_spec)
sys.modules["apiserver_admission"] = admission
_spec.loader.exec_module(admission)

CONFIG_DIR = "/etc/kubernetes/qgpu-admission"
CONFIG = f"{CONFIG_DIR}/admission.yaml"
KUBECONFIG = f"{CONFIG_DIR}/webhooks.kubeconfig"
# The first release of each format and the current one.
VERSIONS = {"1.14.10": "v1alpha1", "1.16.15": "v1alpha1", "1.17.17": "v1", "1.28.15": "v1", "1.37.2": "v1"}


def kubeadm_manifest(version: str = "1.28.15", extra: tuple[str, ...] = ()) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "kube-apiserver", "namespace": "kube-system", "labels": {"component": "kube-apiserver"}},
            "spec": {"containers": [{"name": "kube-apiserver", "image": f"registry.k8s.io/kube-apiserver:v{version}",
                                     "command": ["kube-apiserver", "--advertise-address=10.0.0.1", "--secure-port=6443",
                                                 "--enable-admission-plugins=NodeRestriction", *extra],
                                     "volumeMounts": [{"name": "k8s-certs", "mountPath": "/etc/kubernetes/pki", "readOnly": True}]}],
                     "hostNetwork": True,
                     "volumes": [{"name": "k8s-certs", "hostPath": {"path": "/etc/kubernetes/pki", "type": "DirectoryOrCreate"}}]}}


@pytest.mark.parametrize("version, fmt", VERSIONS.items())
def test_the_admission_configuration_has_each_versions_format(version, fmt):
    config = admission.admission_config(version, KUBECONFIG)
    if fmt == "v1":
        assert (config["apiVersion"], config["kind"]) == ("apiserver.config.k8s.io/v1", "AdmissionConfiguration")
        inner = ("apiserver.config.k8s.io/v1", "WebhookAdmissionConfiguration")
    else:
        assert (config["apiVersion"], config["kind"]) == ("apiserver.k8s.io/v1alpha1", "AdmissionConfiguration")
        inner = ("apiserver.config.k8s.io/v1alpha1", "WebhookAdmission")
    assert [p["name"] for p in config["plugins"]] == ["ValidatingAdmissionWebhook", "MutatingAdmissionWebhook"]
    for plugin in config["plugins"]:
        assert plugin["configuration"] == {"apiVersion": inner[0], "kind": inner[1], "kubeConfigFile": KUBECONFIG}


def test_the_v1_format_is_the_one_the_test_control_plane_gives_kube_apiserver(tmp_path):
    from tests.k8s.controlplane import ControlPlane

    cp = ControlPlane(tmp_path, tmp_path)  # writes its files; starts nothing
    ours = yaml.safe_load(cp.admission_config.read_text())
    rendered = admission.admission_config("1.37.2", ours["plugins"][0]["configuration"]["kubeConfigFile"])
    assert ours == rendered


@pytest.mark.parametrize("namespace, url, port, names", [
    ("kube-system", "", 443, ["qgpu-webhook.kube-system.svc"]),
    ("qgpu", "", 8443, ["qgpu-webhook.qgpu.svc:8443", "qgpu-webhook.qgpu.svc"]),
    ("kube-system", "https://10.0.0.5:8443", 443, ["10.0.0.5:8443"]),
    ("kube-system", "https://webhook.example.com", 443, ["webhook.example.com"]),
])
def test_the_certificate_goes_to_the_webhooks_exact_names_only(namespace, url, port, names):
    assert admission.webhook_user_names(namespace, url, port=port) == names
    assert "*" not in json.dumps(admission.admission_kubeconfig(names, "c", "k"))


@pytest.mark.parametrize("call, message", [
    (lambda: admission.webhook_user_names("kube-system", "http://10.0.0.5:8443"), "must be https://HOST"),
    (lambda: admission.webhook_user_names("Bad_NS"), "'Bad_NS': must be a namespace name"),
    (lambda: admission.admission_config("1.13.0", KUBECONFIG), "qgpu supports Kubernetes 1.14 and later"),
    (lambda: admission.admission_config("latest", KUBECONFIG), "'latest': expected MAJOR.MINOR"),
])
def test_nonsense_is_refused_naming_the_value(call, message):
    with pytest.raises(AnsibleFilterError, match=message):
        call()


def test_wiring_adds_the_flag_mount_and_checksum_and_unwiring_restores_kubeadms_manifest():
    manifest = kubeadm_manifest()
    wired = admission.apiserver_admission_wire(manifest, CONFIG, CONFIG_DIR, "sum1")
    container = wired["spec"]["containers"][0]
    assert container["command"][-1] == f"--admission-control-config-file={CONFIG}"
    assert {"name": "qgpu-admission-config", "mountPath": CONFIG_DIR, "readOnly": True} in container["volumeMounts"]
    assert wired["metadata"]["annotations"] == {"qgpu.io/admission-config-checksum": "sum1"}
    assert admission.apiserver_admission_is_wired(wired, CONFIG)
    assert admission.apiserver_admission_wire(wired, CONFIG, CONFIG_DIR, "sum1") == wired  # idempotent
    again = admission.apiserver_admission_wire(wired, CONFIG, CONFIG_DIR, "sum2")  # rotated certificate
    assert again["metadata"]["annotations"]["qgpu.io/admission-config-checksum"] == "sum2"
    assert again["spec"]["containers"][0]["command"].count(f"--admission-control-config-file={CONFIG}") == 1
    unwired = admission.apiserver_admission_unwire(wired, CONFIG_DIR)
    unwired["metadata"].pop("annotations")
    assert unwired == manifest
    assert not admission.apiserver_admission_is_wired(manifest, CONFIG)


def test_a_foreign_admission_configuration_is_refused_not_replaced():
    manifest = kubeadm_manifest(extra=("--admission-control-config-file=/etc/kubernetes/pod-security.yaml",))
    with pytest.raises(AnsibleFilterError, match="already has --admission-control-config-file=/etc/kubernetes/pod-security.yaml"):
        admission.apiserver_admission_wire(manifest, CONFIG, CONFIG_DIR, "sum")


def test_the_version_comes_from_the_image_tag():
    assert admission.apiserver_version_from_manifest(kubeadm_manifest("1.30.4")) == "1.30.4"


# -- the role, on sandboxed kubeadm masters ---------------------------------------------------------

def _run_role(sandbox: Path, versions: list[str], **role_vars: object) -> str:
    playbook = sandbox / "play.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Wire the admission configuration", "hosts": "localhost", "connection": "local", "gather_facts": False,
        "vars": {"ansible_python_interpreter": "{{ ansible_playbook_python }}"},
        "tasks": [{"name": "Wire", "ansible.builtin.include_role": {"name": "kube_apiserver_admission"},
                   "loop": versions, "loop_control": {"loop_var": "kube_version"},
                   "vars": {"kube_apiserver_admission_root": f"{sandbox}/{{{{ kube_version }}}}",
                            "kube_apiserver_admission_wait_healthy": False,
                            "kube_apiserver_admission_client_cert_pem": "test certificate",
                            "kube_apiserver_admission_client_key_pem": "test key", **role_vars}}]}]))
    run = ansible_playbook("-i", "localhost,", str(playbook))
    assert run.returncode == 0, run.output[-4000:]
    return run.output


@pytest.fixture(scope="module")
def masters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sandbox = tmp_path_factory.mktemp("apiserver-masters")
    for version in VERSIONS:
        manifests = sandbox / version / "etc/kubernetes/manifests"
        manifests.mkdir(parents=True)
        (manifests / "kube-apiserver.yaml").write_text(yaml.safe_dump(kubeadm_manifest(version)))
    _run_role(sandbox, list(VERSIONS), kube_apiserver_admission_webhook_namespace="qgpu")
    return sandbox


@pytest.mark.parametrize("version", VERSIONS)
def test_the_role_writes_each_versions_files_and_wires_them(masters, version):
    root = masters / version
    config = yaml.safe_load((root / CONFIG.lstrip("/")).read_text())
    assert config == admission.admission_config(version, KUBECONFIG)
    kubeconfig = yaml.safe_load((root / KUBECONFIG.lstrip("/")).read_text())
    assert [u["name"] for u in kubeconfig["users"]] == ["qgpu-webhook.qgpu.svc"]
    assert kubeconfig["users"][0]["user"] == {"client-certificate": f"{CONFIG_DIR}/qgpu-webhook-client.crt",
                                              "client-key": f"{CONFIG_DIR}/qgpu-webhook-client.key"}
    key = root / CONFIG_DIR.lstrip("/") / "qgpu-webhook-client.key"
    assert key.read_text() == "test key" and stat.S_IMODE(key.stat().st_mode) == 0o600
    manifest = yaml.safe_load((root / "etc/kubernetes/manifests/kube-apiserver.yaml").read_text())
    assert admission.apiserver_admission_is_wired(manifest, CONFIG)


def test_a_second_run_changes_nothing_and_logs_no_key(masters):
    output = _run_role(masters, list(VERSIONS), kube_apiserver_admission_webhook_namespace="qgpu")
    assert "changed=0" in output, output[-2000:]
    assert "test key" not in output


def test_absent_restores_kubeadms_manifest_and_removes_the_files(tmp_path):
    manifests = tmp_path / "m/etc/kubernetes/manifests"
    manifests.mkdir(parents=True)
    original = kubeadm_manifest("1.30.4")
    (manifests / "kube-apiserver.yaml").write_text(yaml.safe_dump(original))
    _run_role(tmp_path, ["m"])
    assert (tmp_path / "m" / CONFIG.lstrip("/")).exists()
    _run_role(tmp_path, ["m"], kube_apiserver_admission_state="absent")
    restored = yaml.safe_load((manifests / "kube-apiserver.yaml").read_text())
    restored["metadata"].pop("annotations", None)
    assert restored == original
    assert not (tmp_path / "m" / CONFIG_DIR.lstrip("/")).exists()
