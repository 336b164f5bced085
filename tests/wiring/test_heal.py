"""The master's re-wiring watcher (qgpu_runtime/wiring): after an upgrade rewrites kube-scheduler's
static pod manifest, the wiring comes back, in the config format of the new version, once."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from qgpu_runtime.cli import main
from qgpu_runtime.wiring import formats
from qgpu_runtime.wiring.heal import STATE_FIELDS, StateError, Watcher, heal

CONFIG_DIR = "/etc/kubernetes/qgpu"
TLS = ["a" * 64, "b" * 64]


def kubeadm_manifest(version: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "kube-scheduler", "namespace": "kube-system"},
        "spec": {"containers": [{
            "name": "kube-scheduler", "image": f"registry.k8s.io/kube-scheduler:v{version}",
            "command": ["kube-scheduler", "--kubeconfig=/etc/kubernetes/scheduler.conf", "--leader-elect=true"]}]},
    }


def config_text(fmt: str) -> str:
    return (f"# written by the role\napiVersion: kubescheduler.config.k8s.io/{fmt}\nkind: KubeSchedulerConfiguration\n"
            "extenders:\n- urlPrefix: https://127.0.0.1:12345\n  filterVerb: filter\n")


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def master(tmp_path: Path):
    """A master as the role leaves it: wired manifest, config file and state, under tmp_path as root."""
    def make(version: str = "1.24.17", fmt: str = "v1beta3", requested: str = "auto") -> Path:
        root = str(tmp_path)
        (tmp_path / "etc/kubernetes/manifests").mkdir(parents=True)
        (tmp_path / CONFIG_DIR.lstrip("/")).mkdir(parents=True)
        config_file = f"{CONFIG_DIR}/kube-scheduler-config.yaml"
        text = config_text(fmt)
        (tmp_path / config_file.lstrip("/")).write_text(text)
        checksum = formats.restart_checksum(sha(text), TLS)
        wired = formats.scheduler_wire(kubeadm_manifest(version), fmt, config_file, CONFIG_DIR, checksum)
        (tmp_path / "etc/kubernetes/manifests/kube-scheduler.yaml").write_text(yaml.safe_dump(wired))
        state = {"root": root, "manifest": "/etc/kubernetes/manifests/kube-scheduler.yaml", "config_dir": CONFIG_DIR,
                 "kubernetes_version": version, "format": fmt, "requested_format": requested, "config_file": config_file,
                 "config_sha256": sha(text), "restart_sha256": checksum, "tls_sha256": TLS, "node": "master-1"}
        path = tmp_path / CONFIG_DIR.lstrip("/") / "state.json"
        path.write_text(json.dumps(state))
        return path
    return make


def manifest_of(state_path: Path) -> dict:
    state = json.loads(state_path.read_text())
    return yaml.safe_load(Path(state["root"] + state["manifest"]).read_text())


def upgrade(state_path: Path, version: str) -> None:
    """What kubeadm upgrade apply does: a fresh manifest, new image tag, no qgpu wiring."""
    state = json.loads(state_path.read_text())
    Path(state["root"] + state["manifest"]).write_text(yaml.safe_dump(kubeadm_manifest(version)))


def test_a_wired_master_is_left_alone(master) -> None:
    state_path = master()
    before = state_path.read_text(), manifest_of(state_path)
    outcome = heal(state_path)
    assert not outcome.changed and "is wired (v1beta3" in outcome.what
    assert (state_path.read_text(), manifest_of(state_path)) == before


def test_an_upgrade_to_a_minor_with_another_format_is_rewired_in_that_format(master) -> None:
    state_path = master("1.24.17", "v1beta3")
    upgrade(state_path, "1.25.16")
    outcome = heal(state_path)
    assert outcome.changed
    assert "upgraded from 1.24.17 to 1.25.16" in outcome.what and "config rewritten from v1beta3 to v1" in outcome.what
    assert "was rewritten without the qgpu wiring" in outcome.what
    state = json.loads(state_path.read_text())
    config = Path(state["root"] + state["config_file"]).read_text()
    assert "apiVersion: kubescheduler.config.k8s.io/v1\n" in config and config.startswith("# written by the role")
    manifest = manifest_of(state_path)
    assert formats.scheduler_is_wired(manifest, "v1", state["config_file"], CONFIG_DIR)
    assert manifest["spec"]["containers"][0]["image"].endswith(":v1.25.16")
    # the annotation is the role's checksum of the new config and the TLS files: kube-scheduler restarts with it
    assert manifest["metadata"]["annotations"][formats.CHECKSUM_ANNOTATION] == formats.restart_checksum(sha(config), TLS)
    assert state["kubernetes_version"] == "1.25.16" and state["format"] == "v1" and state["healed"]["what"] == outcome.what
    assert not heal(state_path).changed  # once


def test_a_regenerated_manifest_of_the_same_version_gets_its_wiring_back(master) -> None:
    state_path = master("1.31.4", "v1")
    wired = manifest_of(state_path)
    upgrade(state_path, "1.31.4")
    outcome = heal(state_path)
    assert outcome.changed and "rewritten without the qgpu wiring" in outcome.what and "upgraded" not in outcome.what
    assert manifest_of(state_path) == wired


def test_a_forced_format_the_new_version_cannot_read_falls_back_to_its_default(master) -> None:
    state_path = master("1.28.15", "v1beta3", requested="v1beta3")
    upgrade(state_path, "1.29.10")  # v1beta3 is gone in 1.29
    outcome = heal(state_path)
    assert "config rewritten from v1beta3 to v1 (the forced format v1beta3 is unreadable by 1.29.10" in outcome.what


def test_a_policy_config_is_not_guessed_into_a_component_config(master, tmp_path: Path) -> None:
    state_path = master("1.18.20", "v1beta1")
    state = json.loads(state_path.read_text())
    state.update(format="policy", config_file=f"{CONFIG_DIR}/scheduler-policy.json")
    (tmp_path / CONFIG_DIR.lstrip("/") / "scheduler-policy.json").write_text("{}")
    state_path.write_text(json.dumps(state))
    upgrade(state_path, "1.19.16")
    with pytest.raises(formats.WiringError, match="run playbooks/reapply-scheduler-extender.yml"):
        heal(state_path)


def test_a_foreign_config_flag_is_refused_not_overwritten(master) -> None:
    state_path = master("1.30.2", "v1")
    manifest = kubeadm_manifest("1.30.2")
    manifest["spec"]["containers"][0]["command"].append("--config=/etc/kubernetes/other.yaml")
    state = json.loads(state_path.read_text())
    Path(state["root"] + state["manifest"]).write_text(yaml.safe_dump(manifest))
    with pytest.raises(formats.WiringError, match="will not replace a configuration it did not write"):
        heal(state_path)
    assert manifest_of(state_path) == manifest


@pytest.mark.parametrize("field", STATE_FIELDS)
def test_a_state_file_without_a_field_is_refused_by_name(master, field: str) -> None:
    state_path = master()
    state = json.loads(state_path.read_text())
    del state[field]
    state_path.write_text(json.dumps(state))
    with pytest.raises(StateError, match=f"lacks {field} .*reapply-scheduler-extender.yml"):
        heal(state_path)


def test_the_watcher_reports_each_rewiring_once_and_each_failure_once(master) -> None:
    state_path = master("1.30.2", "v1")
    events: list[tuple[str, str, str]] = []
    watcher = Watcher(state_path, lambda *event: events.append(event))
    assert watcher.tick() is not None and events == []  # first look: wired, nothing to say
    assert watcher.tick() is None  # nothing changed since
    upgrade(state_path, "1.31.0")
    watcher.tick()
    assert [(kind, reason) for kind, reason, _ in events] == [("Normal", "SchedulerRewired")]
    assert "upgraded from 1.30.2 to 1.31.0" in events[0][2]
    assert watcher.tick() is None  # its own write is not news
    state = json.loads(state_path.read_text())
    manifest_path = Path(state["root"] + state["manifest"])
    foreign = kubeadm_manifest("1.31.0")
    foreign["spec"]["containers"][0]["command"].append("--config=/etc/other.yaml")
    manifest_path.write_text(yaml.safe_dump(foreign))
    watcher.tick()
    manifest_path.write_text(yaml.safe_dump(foreign) + "\n")  # touched again, same failure
    watcher.tick()
    assert [reason for _, reason, _ in events] == ["SchedulerRewired", "SchedulerWiringFailed"]
    assert "--config=/etc/other.yaml" in events[1][2]
    manifest_path.unlink()  # kubeadm moved it away: wait, no report
    assert watcher.tick() is None and len(events) == 2
    manifest_path.write_text(yaml.safe_dump(kubeadm_manifest("1.31.0")))
    watcher.tick()
    assert events[-1][1] == "SchedulerRewired"


def test_an_upgrade_written_while_the_watcher_wires_the_old_manifest_is_not_overwritten(master, monkeypatch) -> None:
    """kubeadm writes 1.31's manifest between the watcher's reading 1.30's and its write: the
    watcher writes nothing over it (before, the old image came back, wired), and its next look wires
    the new one."""
    state_path = master("1.30.2", "v1")
    upgrade(state_path, "1.30.2")  # unwired: the watcher has work to do
    events: list[tuple[str, str, str]] = []
    watcher = Watcher(state_path, lambda *event: events.append(event))
    real_wire = formats.scheduler_wire
    raced = []

    def wire_while_kubeadm_writes(*args, **kwargs):
        if not raced:
            raced.append(True)
            upgrade(state_path, "1.31.0")
        return real_wire(*args, **kwargs)

    monkeypatch.setattr(formats, "scheduler_wire", wire_while_kubeadm_writes)
    assert watcher.tick() is None and events == []  # nothing written, nothing reported
    container = manifest_of(state_path)["spec"]["containers"][0]
    assert container["image"].endswith(":v1.31.0") and not formats.scheduler_is_wired(
        manifest_of(state_path), "v1", json.loads(state_path.read_text())["config_file"], CONFIG_DIR)
    outcome = watcher.tick()
    assert outcome is not None and outcome.changed and "upgraded from 1.30.2 to 1.31.0" in outcome.what
    assert manifest_of(state_path)["spec"]["containers"][0]["image"].endswith(":v1.31.0")
    assert [reason for _, reason, _ in events] == ["SchedulerRewired"]


def test_the_check_command_exits_by_outcome(master, capsys) -> None:
    state_path = master("1.30.2", "v1")
    assert main(["scheduler-wiring", "check", "--state", str(state_path)]) == 0
    upgrade(state_path, "1.30.2")
    assert main(["scheduler-wiring", "check", "--state", str(state_path)]) == 1
    assert "rewritten without the qgpu wiring" in capsys.readouterr().out
    assert main(["scheduler-wiring", "check", "--state", str(state_path.parent / "missing.json")]) == 2
    assert "no state file; run the kube_scheduler_extender role" in capsys.readouterr().err
    assert main(["scheduler-wiring", "watch", "--state", str(state_path), "--interval", "0"]) == 2
    assert "--interval 0.0: must be between 0.2 and 60.0 seconds" in capsys.readouterr().err


def test_the_check_command_wires_the_manifest_kubeadm_wrote_while_it_was_wiring(master, monkeypatch, capsys) -> None:
    """`check` reads a manifest changed under it again (before, a traceback and exit 1, "re-wired",
    with nothing written); one that never stops changing is exit 2, saying so."""
    state_path = master("1.30.2", "v1")
    upgrade(state_path, "1.30.2")
    real_wire = formats.scheduler_wire
    races = [1]

    def wire_while_kubeadm_writes(*args, **kwargs):
        if races[0]:
            races[0] -= 1
            upgrade(state_path, f"1.31.{races[0]}")  # each race a manifest of its own
        return real_wire(*args, **kwargs)

    monkeypatch.setattr(formats, "scheduler_wire", wire_while_kubeadm_writes)
    assert main(["scheduler-wiring", "check", "--state", str(state_path)]) == 1
    assert "upgraded from 1.30.2 to 1.31.0" in capsys.readouterr().out
    assert manifest_of(state_path)["spec"]["containers"][0]["image"].endswith(":v1.31.0")
    races[0] = 4
    upgrade(state_path, "1.31.9")
    assert main(["scheduler-wiring", "check", "--state", str(state_path)]) == 2
    assert "changed while the watcher wired it" in capsys.readouterr().err


def test_a_missing_config_file_is_a_failure_reported_not_a_wait(master) -> None:
    state_path = master("1.30.2", "v1")
    state = json.loads(state_path.read_text())
    Path(state["root"] + state["config_file"]).unlink()
    upgrade(state_path, "1.30.2")
    events: list[tuple[str, str, str]] = []
    Watcher(state_path, lambda *event: events.append(event)).tick()
    assert [(kind, reason) for kind, reason, _ in events] == [("Warning", "SchedulerWiringFailed")]
    assert "kube-scheduler-config.yaml" in events[0][2]


def test_check_names_a_manifest_that_does_not_parse(master, capsys) -> None:
    state_path = master("1.30.2", "v1")
    state = json.loads(state_path.read_text())
    Path(state["root"] + state["manifest"]).write_text("spec: [unclosed\n")
    assert main(["scheduler-wiring", "check", "--state", str(state_path)]) == 2
    assert "qgpu scheduler-wiring:" in capsys.readouterr().err


def test_a_pinned_version_is_what_the_watcher_wires_for_as_the_role_did(master) -> None:
    state_path = master("1.28", "v1")
    state = json.loads(state_path.read_text())
    state["pinned_version"] = "1.28"  # kube_scheduler_extender_kubernetes_version, beside an image tagged v1.28.15
    state_path.write_text(json.dumps(state))
    manifest = manifest_of(state_path)
    manifest["spec"]["containers"][0]["image"] = "registry.k8s.io/kube-scheduler:v1.28.15"
    Path(state["root"] + state["manifest"]).write_text(yaml.safe_dump(manifest))
    assert not heal(state_path).changed


def test_an_event_message_is_bounded() -> None:
    from qgpu_runtime.kube.events import MAX_MESSAGE, event_body, node_reference

    body = event_body("default", node_reference("m-1"), "Warning", "SchedulerWiringFailed", "x" * 5000, {"component": "c"})
    assert len(body["message"]) == MAX_MESSAGE and body["involvedObject"]["name"] == "m-1"
