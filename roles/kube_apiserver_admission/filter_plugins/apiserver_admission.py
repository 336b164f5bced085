"""Filters for making kube-apiserver present a client certificate to the qgpu webhook.

kube-apiserver authenticates itself to admission webhooks only through its admission
configuration (``--admission-control-config-file``): an AdmissionConfiguration whose
ValidatingAdmissionWebhook and MutatingAdmissionWebhook plugins name a kubeconfig, whose ``users``
entry named for the webhook's host carries the client certificate. Why Python and not Jinja: the
file formats by version, the user names a webhook is looked up by, and editing kubeadm's static pod
are small pure functions with cases; they are unit-tested directly
(tests/provisioning/test_apiserver_admission.py) and the role only moves files.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ansible.errors import AnsibleFilterError

_CHECKOUT = str(Path(__file__).resolve().parents[3])
if _CHECKOUT not in sys.path:
    sys.path.insert(0, _CHECKOUT)

# kubeadm static pod helpers shared with kube_scheduler_extender (this checkout's runtime package)
from qgpu_runtime.wiring import formats  # noqa: E402

CONFIG_FLAG = "--admission-control-config-file"
CONFIG_VOLUME = "qgpu-admission-config"
CHECKSUM_ANNOTATION = "qgpu.io/admission-config-checksum"
OLDEST_SUPPORTED = (1, 14)
# AdmissionConfiguration and WebhookAdmissionConfiguration reached v1 in 1.17 (apiserver.config.k8s.io/v1);
# 1.14-1.16 read apiserver.k8s.io/v1alpha1 with apiserver.config.k8s.io/v1alpha1 WebhookAdmission.
V1_FIRST = (1, 17)
PLUGINS = ("ValidatingAdmissionWebhook", "MutatingAdmissionWebhook")


def _minor(version: str) -> tuple[int, int]:
    match = re.match(r"^v?(\d+)\.(\d+)", str(version).strip())
    if not match:
        raise AnsibleFilterError(f"kube-apiserver version {version!r}: expected MAJOR.MINOR[.PATCH], e.g. 1.28.3")
    minor = int(match.group(1)), int(match.group(2))
    if minor < OLDEST_SUPPORTED:
        raise AnsibleFilterError(f"kube-apiserver {version}: qgpu supports Kubernetes 1.14 and later")
    return minor


def admission_config(version: str, kubeconfig_file: str) -> dict[str, Any]:
    """The AdmissionConfiguration kube-apiserver ``version`` reads, both webhook plugins naming
    ``kubeconfig_file``."""
    if _minor(version) >= V1_FIRST:
        outer, inner = ("apiserver.config.k8s.io/v1", "AdmissionConfiguration"), ("apiserver.config.k8s.io/v1", "WebhookAdmissionConfiguration")
    else:
        outer, inner = ("apiserver.k8s.io/v1alpha1", "AdmissionConfiguration"), ("apiserver.config.k8s.io/v1alpha1", "WebhookAdmission")
    plugin = {"apiVersion": inner[0], "kind": inner[1], "kubeConfigFile": kubeconfig_file}
    return {"apiVersion": outer[0], "kind": outer[1],
            "plugins": [{"name": name, "configuration": dict(plugin)} for name in PLUGINS]}


def webhook_user_names(namespace: str, url: str = "", service: str = "qgpu-webhook", port: int = 443) -> list[str]:
    """The kubeconfig ``users`` names kube-apiserver looks the webhook up by: the Service's DNS
    name (with ``:port`` when not 443, which 1.16+ require), or the URL's host[:port] as written.
    Exact names only: the certificate goes to qgpu's webhook and to nothing else."""
    if url:
        parts = urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            raise AnsibleFilterError(f"webhook URL {url!r}: must be https://HOST[:PORT]")
        return [parts.netloc.rsplit("@", 1)[-1]]
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", namespace or ""):
        raise AnsibleFilterError(f"webhook namespace {namespace!r}: must be a namespace name")
    host = f"{service}.{namespace}.svc"
    return [host] if int(port) == 443 else [f"{host}:{port}", host]


def admission_kubeconfig(names: list[str], cert_file: str, key_file: str) -> dict[str, Any]:
    """The kubeconfig the webhook plugins read: one user per name, each the same client certificate."""
    if not names:
        raise AnsibleFilterError("admission kubeconfig: no webhook names")
    user = {"client-certificate": cert_file, "client-key": key_file}
    return {"apiVersion": "v1", "kind": "Config", "users": [{"name": n, "user": dict(user)} for n in names]}


def apiserver_version_from_manifest(manifest: dict[str, Any]) -> str:
    """Version from the kube-apiserver container's image tag (kubeadm: registry/kube-apiserver:v1.28.3)."""
    version = formats.translated(formats.component_version, AnsibleFilterError)
    return version(manifest, "kube-apiserver", "kube_apiserver_admission_kubernetes_version")


def _container(manifest: dict[str, Any]) -> dict[str, Any]:
    return formats.translated(formats.static_pod_container, AnsibleFilterError)(manifest, "kube-apiserver")


_flag_name = formats.flag_name
_is_ours = formats.flag_under


def apiserver_admission_wire(manifest: dict[str, Any], config_file: str, config_dir: str, checksum: str) -> dict[str, Any]:
    """A copy of the static pod ``manifest`` that loads ``config_file``: the flag in ``command``
    (where kubeadm writes every flag), the directory mounted read-only, and the files' checksum as
    an annotation, so kubelet restarts kube-apiserver exactly when the configuration or the
    certificate changed. A foreign ``--admission-control-config-file`` is refused, never replaced:
    it may hold other plugins' settings (PodSecurity, EventRateLimit)."""
    wired = copy.deepcopy(manifest)
    container = _container(wired)
    for field in ("command", "args"):
        for arg in container.get(field) or []:
            if _flag_name(arg) == CONFIG_FLAG and not _is_ours(arg, config_dir):
                raise AnsibleFilterError(
                    f"kube-apiserver manifest: {field} already has {arg}; qgpu will not replace an admission configuration "
                    f"it did not write. Add the ValidatingAdmissionWebhook and MutatingAdmissionWebhook plugins naming "
                    f"{config_dir}/webhooks.kubeconfig to that file, or remove the flag and re-run.")
    for field in ("command", "args"):
        if container.get(field):
            container[field] = [a for a in container[field] if _flag_name(a) != CONFIG_FLAG]
    flag = f"{CONFIG_FLAG}={config_file}"
    if container.get("command"):
        container["command"] = container["command"] + [flag]
    else:
        container["args"] = (container.get("args") or []) + [flag]
    if container.get("args") == []:
        del container["args"]
    formats.mount_config_dir(wired, container, CONFIG_VOLUME, config_dir, CHECKSUM_ANNOTATION, checksum)
    return wired


def apiserver_admission_is_wired(manifest: dict[str, Any], config_file: str) -> bool:
    """True when the manifest still loads ``config_file`` (kubeadm upgrades regenerate it without)."""
    container = _container(manifest)
    return f"{CONFIG_FLAG}={config_file}" in [*(container.get("command") or []), *(container.get("args") or [])]


def apiserver_admission_unwire(manifest: dict[str, Any], config_dir: str) -> dict[str, Any]:
    """Undo :func:`apiserver_admission_wire`."""
    unwired = copy.deepcopy(manifest)
    container = _container(unwired)
    for field in ("command", "args"):
        if field in container:
            container[field] = [a for a in container[field] if not (_flag_name(a) == CONFIG_FLAG and _is_ours(a, config_dir))]
    if container.get("args") == []:
        del container["args"]
    formats.drop_volume(unwired, container, CONFIG_VOLUME)
    annotations = (unwired.get("metadata") or {}).get("annotations")
    if annotations and CHECKSUM_ANNOTATION in annotations:
        del annotations[CHECKSUM_ANNOTATION]
    return unwired


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "apiserver_admission_config": admission_config,
            "apiserver_admission_kubeconfig": admission_kubeconfig,
            "apiserver_webhook_user_names": webhook_user_names,
            "apiserver_version_from_manifest": apiserver_version_from_manifest,
            "apiserver_admission_wire": apiserver_admission_wire,
            "apiserver_admission_is_wired": apiserver_admission_is_wired,
            "apiserver_admission_unwire": apiserver_admission_unwire,
        }
