"""Which config format each kube-scheduler reads, and the kubeadm static pod's wiring.

Pure functions over parsed manifests (dicts) and version strings, unit-tested directly
(tests/provisioning/test_scheduler_wiring.py). The kube_scheduler_extender role's filters and the
master's re-wiring watcher (wiring/heal.py) both call them: one definition of "wired".
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from typing import Any, Callable


class WiringError(ValueError):
    """A manifest, version or format qgpu cannot wire; the message names the field and the rule."""


CONFIG_VOLUME = "qgpu-scheduler-config"
CHECKSUM_ANNOTATION = "qgpu.io/scheduler-config-checksum"
# Flags that select a scheduler configuration; the wiring owns them.
CONFIG_FLAGS = ("--config", "--policy-config-file", "--use-legacy-policy-config",
                "--policy-configmap", "--policy-configmap-namespace")
# The flags that name a scheduling configuration; one qgpu did not write is refused, not replaced.
FOREIGN_CONFIG_FLAGS = ("--config", "--policy-config-file", "--policy-configmap")
OLDEST_SUPPORTED = (1, 14)
# resource.k8s.io/v1 (DRA, GA): the first kube-scheduler that allocates ResourceClaims by default.
DRA_FIRST = (1, 34)


@dataclass(frozen=True)
class FormatSpan:
    """Kubernetes minors (inclusive) in which kube-scheduler reads a config format."""

    first: tuple[int, int]
    last: tuple[int, int] | None  # None: still current

    def covers(self, version: tuple[int, int]) -> bool:
        return self.first <= version and (self.last is None or version <= self.last)

    def describe(self) -> str:
        first = f"1.{self.first[1]}"
        return f"{first}-1.{self.last[1]}" if self.last else f"{first}+"


# Policy: removed in 1.23 (kubernetes#105424). v1beta1: 1.19-1.22; v1beta2: 1.22-1.27;
# v1beta3: 1.23-1.28; v1: 1.25 onwards (kube-scheduler config/<ver>/types.go per tag).
FORMATS: dict[str, FormatSpan] = {
    "policy": FormatSpan(OLDEST_SUPPORTED, (1, 22)),
    "v1beta1": FormatSpan((1, 19), (1, 22)),
    "v1beta2": FormatSpan((1, 22), (1, 27)),
    "v1beta3": FormatSpan((1, 23), (1, 28)),
    "v1": FormatSpan((1, 25), None),
}


def parse_minor(version: str) -> tuple[int, int]:
    """'v1.28.3', '1.28', '1.22.17-tke.1' -> (1, 28)."""
    match = re.match(r"^v?(\d+)\.(\d+)", str(version).strip())
    if not match:
        raise WiringError(f"kube-scheduler version {version!r}: expected MAJOR.MINOR[.PATCH], e.g. 1.22.17")
    return int(match.group(1)), int(match.group(2))


def default_format(version: str) -> str:
    """The newest format the version reads, except that 1.22 keeps v1beta2 and 1.23-1.24 v1beta3."""
    minor = parse_minor(version)
    if minor < OLDEST_SUPPORTED:
        raise WiringError(f"kube-scheduler {version}: qgpu supports Kubernetes 1.14 and later")
    if minor <= (1, 18):
        return "policy"
    if minor <= (1, 21):
        return "v1beta1"
    if minor == (1, 22):
        return "v1beta2"
    if minor <= (1, 24):
        return "v1beta3"
    return "v1"


def scheduler_config_format(version: str, requested: str = "auto") -> str:
    """Resolve ``auto`` for ``version``, or check that ``requested`` is readable by it."""
    if requested == "auto":
        return default_format(version)
    if requested not in FORMATS:
        raise WiringError(
            f"kube_scheduler_extender_config_format {requested!r}: choose auto or one of {', '.join(FORMATS)}")
    minor = parse_minor(version)
    span = FORMATS[requested]
    if not span.covers(minor):
        readable = [name for name, s in FORMATS.items() if s.covers(minor)]
        raise WiringError(
            f"kube_scheduler_extender_config_format {requested!r}: kube-scheduler {version} cannot read it "
            f"({requested} works with Kubernetes {span.describe()}); {version} reads {', '.join(readable) or 'none of them'}")
    return requested


def scheduler_has_dra(version: str) -> bool:
    """True when kube-scheduler ``version`` allocates ResourceClaims (resource.k8s.io/v1, 1.34 on)."""
    return parse_minor(version) >= DRA_FIRST


def scheduler_version_from_manifest(manifest: dict[str, Any]) -> str:
    """Version from the kube-scheduler container's image tag (kubeadm: registry/kube-scheduler:v1.28.3)."""
    return component_version(manifest, "kube-scheduler", "kube_scheduler_extender_kubernetes_version")


# --- kubeadm static pods, whichever component (kube-scheduler here, kube-apiserver in the
# kube_apiserver_admission role's filters) ------------------------------------------------------

def static_pod_container(manifest: dict[str, Any], component: str) -> dict[str, Any]:
    """The container named ``component`` of a static pod manifest, or its only container."""
    containers = (manifest.get("spec") or {}).get("containers") or []
    for container in containers:
        if container.get("name") == component:
            return container
    if len(containers) == 1:
        return containers[0]
    raise WiringError(f"{component} manifest: no container named {component} in spec.containers")


def component_version(manifest: dict[str, Any], component: str, version_variable: str) -> str:
    """Version from the ``component`` container's image tag (kubeadm: registry/<component>:v1.28.3);
    without a version tag the error names the variable that sets it."""
    image = str(static_pod_container(manifest, component).get("image", ""))
    tag = image.rsplit(":", 1)[-1] if ":" in image.rsplit("/", 1)[-1] else ""
    if not re.match(r"^v?\d+\.\d+", tag):
        raise WiringError(f"{component} manifest: image {image!r} has no version tag; set {version_variable}")
    return tag.lstrip("v")


def flag_name(arg: str) -> str:
    """``--config=/x`` -> ``--config``."""
    return str(arg).split("=", 1)[0]


def flag_under(arg: str, directory: str) -> bool:
    """True when the flag's value is a path under ``directory`` (a file qgpu wrote)."""
    value = str(arg).split("=", 1)[1] if "=" in str(arg) else ""
    return value.startswith(directory.rstrip("/") + "/")


def mount_config_dir(manifest: dict[str, Any], container: dict[str, Any], volume: str, config_dir: str,
                     annotation: str, checksum: str) -> None:
    """In place: mount ``config_dir`` read-only into ``container`` as ``volume`` (replacing an
    earlier one of that name) and set the pod annotation ``annotation`` to ``checksum``, so a
    changed file changes the manifest and kubelet restarts the component exactly then."""
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != volume]
    container["volumeMounts"] = mounts + [{"name": volume, "mountPath": config_dir, "readOnly": True}]
    spec = manifest.setdefault("spec", {})
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") != volume]
    spec["volumes"] = volumes + [{"name": volume, "hostPath": {"path": config_dir, "type": "DirectoryOrCreate"}}]
    metadata = manifest.setdefault("metadata", {})
    metadata["annotations"] = {**(metadata.get("annotations") or {}), annotation: checksum}


def drop_volume(manifest: dict[str, Any], container: dict[str, Any], volume: str) -> None:
    """Remove the volume named ``volume`` and the container's mount of it, in place."""
    if "volumeMounts" in container:
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m.get("name") != volume]
    spec = manifest.get("spec") or {}
    if "volumes" in spec:
        spec["volumes"] = [v for v in spec["volumes"] if v.get("name") != volume]


def translated(function: Callable[..., Any], error: type[Exception]) -> Callable[..., Any]:
    """``function`` raising ``error`` (e.g. Ansible's AnsibleFilterError) where it raises WiringError:
    how the roles' filter plugins call this module."""
    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except WiringError as exc:
            raise error(str(exc)) from exc
    return wrapped


def _scheduler_container(manifest: dict[str, Any]) -> dict[str, Any]:
    return static_pod_container(manifest, "kube-scheduler")





def wiring_flags(config_format: str, config_file: str) -> list[str]:
    """The kube-scheduler flags that load ``config_file`` in ``config_format``."""
    if config_format == "policy":
        return [f"--policy-config-file={config_file}", "--use-legacy-policy-config=true"]
    return [f"--config={config_file}"]


def scheduler_wire(manifest: dict[str, Any], config_format: str, config_file: str, config_dir: str,
                   checksum: str) -> dict[str, Any]:
    """Return a copy of the static pod ``manifest`` that loads the qgpu scheduler config.

    The flags go to the container's ``args`` (kubeadm writes every flag into ``command``, and
    kubelet appends ``args``), the config directory is mounted read-only, and the config's
    checksum is a pod annotation: a changed config changes the manifest, so kubelet restarts
    kube-scheduler exactly when the config changed, and never otherwise.
    """
    wired = copy.deepcopy(manifest)
    container = _scheduler_container(wired)
    for field in ("command", "args"):
        for arg in container.get(field) or []:
            # a scheduling configuration of the operator's (a file, or a legacy policy ConfigMap, which
            # is never qgpu's) is refused, never dropped: kube-scheduler would lose it without a word
            if flag_name(arg) in FOREIGN_CONFIG_FLAGS and not (flag_name(arg) != "--policy-configmap" and flag_under(arg, config_dir)):
                raise WiringError(
                    f"kube-scheduler manifest: {field} already has {arg}; qgpu will not replace a configuration it did "
                    f"not write. Add the qgpu extender to that file, or remove the flag and re-run.")
    if container.get("command"):
        container["command"] = [a for a in container["command"] if flag_name(a) not in CONFIG_FLAGS]
    args = [a for a in container.get("args") or [] if flag_name(a) not in CONFIG_FLAGS]
    container["args"] = args + wiring_flags(config_format, config_file)

    mount_config_dir(wired, container, CONFIG_VOLUME, config_dir, CHECKSUM_ANNOTATION, checksum)
    return wired


def scheduler_unwire(manifest: dict[str, Any], config_dir: str) -> dict[str, Any]:
    """Undo :func:`scheduler_wire`: drop the qgpu flags, mount and annotation."""
    unwired = copy.deepcopy(manifest)
    container = _scheduler_container(unwired)
    for field in ("command", "args"):
        if field in container:
            container[field] = [a for a in container[field]
                                if not (flag_name(a) in CONFIG_FLAGS and (flag_under(a, config_dir) or flag_name(a) == "--use-legacy-policy-config"))]
    if container.get("args") == []:
        del container["args"]
    drop_volume(unwired, container, CONFIG_VOLUME)
    annotations = (unwired.get("metadata") or {}).get("annotations")
    if annotations is not None:
        annotations.pop(CHECKSUM_ANNOTATION, None)
        if not annotations:
            del unwired["metadata"]["annotations"]
    return unwired


def scheduler_is_wired(manifest: dict[str, Any], config_format: str, config_file: str, config_dir: str) -> bool:
    """True when the manifest loads ``config_file`` (whatever the checksum): False after kubeadm regenerated it."""
    container = _scheduler_container(manifest)
    flags = list(container.get("command") or []) + list(container.get("args") or [])
    mounted = any(m.get("name") == CONFIG_VOLUME and m.get("mountPath") == config_dir
                  for m in container.get("volumeMounts") or [])
    return all(flag in flags for flag in wiring_flags(config_format, config_file)) and mounted


COMPONENT_CONFIG_GROUP = "kubescheduler.config.k8s.io"


def config_file_name(config_format: str) -> str:
    """The file name of the qgpu scheduler config in ``config_format`` (the role's and the watcher's)."""
    return "scheduler-policy.json" if config_format == "policy" else "kube-scheduler-config.yaml"


def restart_checksum(config_sha256: str, tls_sha256: list[str]) -> str:
    """What the static pod's checksum annotation carries: the config's checksum, or with TLS files
    (kube-scheduler reads its extender certificates once, at start) a checksum over all of them."""
    if not tls_sha256:
        return config_sha256
    import hashlib

    return hashlib.sha256(",".join([config_sha256, *tls_sha256]).encode()).hexdigest()


def retarget_config(text: str, old_format: str, new_format: str) -> str:
    """The component config ``text`` (written by the role in ``old_format``) in ``new_format``.

    v1beta1, v1beta2, v1beta3 and v1 spell everything the role writes alike (clientConnection,
    leaderElection, profiles, extenders with enableHTTPS and a duration httpTimeout): only the
    apiVersion differs. The legacy Policy is another document; turning it into a component config
    takes the role's template and its variables, so that step is refused here.
    """
    if old_format == new_format:
        return text
    if "policy" in (old_format, new_format):
        raise WiringError(
            f"the qgpu scheduler config is {old_format} and kube-scheduler now reads {new_format}: the legacy Policy "
            f"and the component config are different documents; run playbooks/reapply-scheduler-extender.yml")
    line = f"apiVersion: {COMPONENT_CONFIG_GROUP}/{old_format}"
    lines = text.splitlines(keepends=True)
    hits = [i for i, current in enumerate(lines) if current.rstrip("\r\n") == line]
    if len(hits) != 1:
        raise WiringError(f"the qgpu scheduler config has {len(hits)} lines {line!r}, expected exactly one; "
                          f"it was not written by the kube_scheduler_extender role")
    lines[hits[0]] = f"apiVersion: {COMPONENT_CONFIG_GROUP}/{new_format}\n"
    return "".join(lines)
