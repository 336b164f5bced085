"""Put kube-scheduler's qgpu wiring back after a master upgrade rewrote its static pod manifest.

``kubeadm upgrade apply`` (or an operator, or another tool) writes a fresh kube-scheduler manifest:
without the qgpu flags, mount and checksum, and with a new image tag whose kube-scheduler may read
another config format. From then on every GPU pod is scheduled without qgpu, silently. The watcher
(`qgpu scheduler-wiring watch`, a systemd service the kube_scheduler_extender role installs on each
master) polls the manifest and, when it is not wired as the role's state file says it should be:

- reads the version from the new image tag and the format that version reads;
- if the format changed, rewrites the qgpu config in the new format (component configs differ in
  apiVersion only: formats.retarget_config);
- wires the manifest with the same function the role uses (formats.scheduler_wire), writes it
  atomically under a hidden name kubelet ignores, and records the new state;
- reports what it did (or why it could not) on stderr and as an Event on the master's Node.

Why a watcher on the master and not a controller in the cluster: the manifest is a file on the
master, kubelet reads it from disk, and the one moment that matters is right after an upgrade,
when kube-scheduler may be restarting or down (a pod-based controller would itself need scheduling
or a privileged host mount of /etc/kubernetes/manifests from a network-facing pod).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from qgpu_runtime.wiring import formats

log = logging.getLogger("qgpu.scheduler-wiring")

# What the role writes into the state file (roles/kube_scheduler_extender/tasks/main.yml) and the
# watcher needs; a state file without them predates the watcher and is refused by name.
STATE_FIELDS = ("root", "manifest", "config_dir", "kubernetes_version", "format", "requested_format",
                "config_file", "tls_sha256", "node")


class StateError(ValueError):
    """The role's state file is missing, unreadable or lacks a field."""


class ManifestChanged(RuntimeError):
    """The manifest changed between the watcher's reading it and its write (an upgrade writing the
    new one meanwhile): nothing was written over it, and the next look wires what is there now."""


@dataclass(frozen=True)
class Outcome:
    """One look at the manifest: ``changed`` when the watcher rewrote it; ``what`` says why, for the
    log and the Event."""

    changed: bool
    what: str


def read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise StateError(f"{path}: no state file; run the kube_scheduler_extender role (playbooks/control-plane.yml) "
                         f"on this master first") from exc
    except (OSError, ValueError) as exc:
        raise StateError(f"{path}: unreadable state file: {exc}") from exc
    if not isinstance(state, dict):
        raise StateError(f"{path}: the state file is {type(state).__name__}, expected a JSON object")
    missing = [field for field in STATE_FIELDS if field not in state]
    if missing:
        raise StateError(f"{path}: the state file lacks {', '.join(missing)} (written by an older role); "
                         f"re-run playbooks/reapply-scheduler-extender.yml on this master")
    return state


def _on_host(state: Mapping[str, Any], path: str) -> Path:
    return Path(f"{state['root']}{path}")


def _write_atomically(path: Path, text: str, mode: int, unless_changed_from: bytes | None = None) -> None:
    """Write ``path`` through a hidden file in its directory and a rename: kubelet skips names that
    start with a dot, and never sees half a manifest.

    ``unless_changed_from``: what the caller read and rewired. The file is read again right before
    the rename, and a file that no longer holds it is left alone (:class:`ManifestChanged`): kubeadm
    writing an upgraded manifest while the watcher wired the old one would otherwise have it put
    back, old image included. What is left is the window between that reading and the rename."""
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".qgpu-tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.chmod(tmp, mode)
        if unless_changed_from is not None and path.read_bytes() != unless_changed_from:
            raise ManifestChanged(f"{path} changed while the watcher wired it: not written; it is read again")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _version(manifest: dict[str, Any], state: Mapping[str, Any]) -> str:
    if state.get("pinned_version"):
        # the operator set kube_scheduler_extender_kubernetes_version: the role wired for it, and so does the watcher
        return str(state["pinned_version"])
    try:
        return formats.scheduler_version_from_manifest(manifest)
    except formats.WiringError:
        # an image without a version tag: the role was given the version (kube_scheduler_extender_kubernetes_version)
        return str(state["kubernetes_version"])


def _format(version: str, state: Mapping[str, Any]) -> tuple[str, str]:
    """The format to write for ``version``, and a note when the operator's forced format no longer fits."""
    requested = str(state["requested_format"])
    try:
        return formats.scheduler_config_format(version, requested), ""
    except formats.WiringError as exc:
        if requested == "auto":
            raise
        return formats.default_format(version), f" (the forced format {requested} is unreadable by {version}: {exc})"


def heal(state_path: Path) -> Outcome:
    """Compare the manifest with the wiring the state asks for and re-wire it when they differ.

    Raises :class:`StateError`, :class:`formats.WiringError` (a manifest or version qgpu will not
    wire: a foreign --config, a Policy config to carry into a component config) or OSError/YAMLError
    (an unreadable manifest, e.g. half written by a tool that does not rename).
    """
    state = read_state(state_path)
    manifest_path = _on_host(state, state["manifest"])
    manifest_bytes = manifest_path.read_bytes()
    manifest = yaml.safe_load(manifest_bytes.decode())
    if not isinstance(manifest, dict):
        raise formats.WiringError(f"{manifest_path}: not a pod manifest (a YAML {type(manifest).__name__})")
    version = _version(manifest, state)
    new_format, note = _format(version, state)
    config_dir = str(state["config_dir"])
    old_file = str(state["config_file"])
    new_file = f"{config_dir}/{formats.config_file_name(new_format)}"
    config_text = _on_host(state, old_file).read_text()
    reasons: list[str] = []
    if version != state["kubernetes_version"]:
        reasons.append(f"kube-scheduler upgraded from {state['kubernetes_version']} to {version}")
    if new_format != state["format"]:
        config_text = formats.retarget_config(config_text, str(state["format"]), new_format)
        reasons.append(f"config rewritten from {state['format']} to {new_format}{note}")
    config_sha256 = hashlib.sha256(config_text.encode()).hexdigest()
    checksum = formats.restart_checksum(config_sha256, list(state["tls_sha256"]))
    wired = formats.scheduler_wire(manifest, new_format, new_file, config_dir, checksum)
    if wired == manifest and not reasons:
        return Outcome(False, f"kube-scheduler {version} is wired ({new_format}, {new_file})")
    if not formats.scheduler_is_wired(manifest, str(state["format"]), old_file, config_dir):
        reasons.append(f"{state['manifest']} was rewritten without the qgpu wiring")
    if new_format != state["format"]:
        _write_atomically(_on_host(state, new_file), config_text, 0o644)
    if wired != manifest:
        _write_atomically(manifest_path, yaml.safe_dump(wired, indent=2, default_flow_style=False), 0o600,
                          unless_changed_from=manifest_bytes)
        reasons.append(f"re-wired as {new_format} ({new_file})")
    updated = dict(state, kubernetes_version=version, format=new_format, config_file=new_file,
                   config_sha256=config_sha256, restart_sha256=checksum,
                   healed={"at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "what": "; ".join(reasons)})
    _write_atomically(state_path, json.dumps(updated, indent=2) + "\n", 0o644)
    return Outcome(True, "; ".join(reasons))


Reporter = Callable[[str, str, str], None]  # (event type, reason, message)


def _fingerprint(*paths: Path) -> tuple[Any, ...]:
    marks: list[Any] = []
    for path in paths:
        try:
            st = path.stat()
            marks.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            marks.append(None)
    return tuple(marks)


class Watcher:
    """Looks again whenever the manifest or the state file changes (and at the first look), reports
    each re-wiring once and each distinct failure once."""

    def __init__(self, state_path: Path, report: Reporter) -> None:
        self.state_path = state_path
        self.report = report
        self._seen: tuple[Any, ...] | None = None
        self._last_failure = ""

    def _manifest_path(self) -> Path | None:
        try:
            state = read_state(self.state_path)
        except StateError:
            return None
        return _on_host(state, state["manifest"])

    def tick(self) -> Outcome | None:
        """One poll: None when nothing changed since the last look."""
        manifest = self._manifest_path()
        mark = _fingerprint(self.state_path, *([manifest] if manifest else []))
        if mark == self._seen:
            return None
        try:
            outcome = heal(self.state_path)
        except FileNotFoundError as exc:
            if manifest is None or Path(str(exc.filename)) != manifest:
                return self._failed(mark, exc)
            # kubeadm moves the old manifest away before it writes the new one: look again
            log.info("waiting: %s", exc)
            return None
        except yaml.YAMLError as exc:
            log.warning("the manifest does not parse (still being written?): %s", exc)
            return None
        except ManifestChanged as exc:
            log.info("looking again: %s", exc)  # nothing recorded as seen: the next tick heals what is there
            return None
        except (StateError, formats.WiringError, OSError) as exc:
            return self._failed(mark, exc)
        # our own write changes the manifest: the next tick sees it wired and says nothing
        self._seen = _fingerprint(self.state_path, *([manifest] if manifest else []))
        self._last_failure = ""
        if outcome.changed:
            log.info("%s", outcome.what)
            self.report("Normal", "SchedulerRewired", f"qgpu scheduler wiring: {outcome.what}")
        return outcome

    def _failed(self, mark: tuple[Any, ...], exc: Exception) -> None:
        """Report a wiring that cannot be done, once until the files change to another failure."""
        self._seen = mark
        message = f"kube-scheduler is not wired to the qgpu extender and qgpu cannot re-wire it: {exc}"
        log.error("%s", message)
        if message != self._last_failure:
            self._last_failure = message
            self.report("Warning", "SchedulerWiringFailed", message)
        return None
