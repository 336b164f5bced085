"""The extender config as the role renders it for every kube-scheduler config format, checked
against the field names each format documents (kube-scheduler config/<version>/types.go and the
1.14-era scheduler Policy API; see docs/provisioning.md). The v1 file is additionally loaded by
a real kube-scheduler in tests/k8s once that fixture exists."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from ansible_tools import REPO, ansible_playbook

# The first (and for Policy, a middle) release of each format; test_scheduler_wiring.py covers
# the version-to-format table in full.
VERSIONS = {"1.16.15": "policy", "1.19.16": "v1beta1", "1.22.17": "v1beta2", "1.23.17": "v1beta3", "1.25.16": "v1"}

# Extender fields of the legacy Policy (pkg/scheduler/api/v1 types.go): Go names decoded
# case-insensitively, enableHttps spelt with a lower-case "ttps", httpTimeout a time.Duration (ns).
POLICY_EXTENDER_FIELDS = {"urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "weight", "bindVerb",
                          "enableHttps", "tlsConfig", "httpTimeout", "nodeCacheCapable", "managedResources", "ignorable"}
# KubeSchedulerConfiguration v1beta1..v1 Extender: enableHTTPS, httpTimeout a metav1.Duration string.
CONFIG_EXTENDER_FIELDS = (POLICY_EXTENDER_FIELDS - {"enableHttps"}) | {"enableHTTPS"}
TLS_FIELDS = {"insecure", "serverName", "certFile", "keyFile", "caFile", "certData", "keyData", "caData"}
MANAGED_RESOURCE_FIELDS = {"name", "ignoredByScheduler"}
CONFIG_TOP_LEVEL = {"apiVersion", "kind", "clientConnection", "leaderElection", "profiles", "extenders"}
# What the qgpu_manager DaemonSet advertises on the nodes: only these are checked against node
# capacity by kube-scheduler; every other managed resource is the extender's alone.
NODE_RESOURCES = {"tke.cloud.tencent.com/qgpu-core", "tke.cloud.tencent.com/qgpu-memory",
                  "tke.cloud.tencent.com/qgpu-core-greedy"}
GO_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sandbox = tmp_path_factory.mktemp("masters")
    run = ansible_playbook("-i", "localhost,", str(REPO / "tests/provisioning/playbooks/render-scheduler-configs.yml"),
                           "-e", json.dumps({"sandbox": str(sandbox), "versions": list(VERSIONS)}))
    assert run.returncode == 0, run.output[-4000:]
    return sandbox


def load_config(rendered: Path, version: str) -> dict:
    qgpu = rendered / version / "etc/kubernetes/qgpu"
    if VERSIONS[version] == "policy":
        return json.loads((qgpu / "scheduler-policy.json").read_text())
    return yaml.safe_load((qgpu / "kube-scheduler-config.yaml").read_text())


@pytest.mark.parametrize("version", [v for v, f in VERSIONS.items() if f == "policy"])
def test_policy_uses_the_legacy_field_names_and_integer_nanoseconds(rendered: Path, version: str) -> None:
    policy = load_config(rendered, version)
    assert set(policy) == {"kind", "apiVersion", "extenders"}
    assert (policy["kind"], policy["apiVersion"]) == ("Policy", "v1")
    (extender,) = policy["extenders"]
    assert set(extender) == POLICY_EXTENDER_FIELDS
    assert extender["enableHttps"] is True
    assert extender["httpTimeout"] == 15_000_000_000 and isinstance(extender["httpTimeout"], int)
    assert set(extender["tlsConfig"]) <= TLS_FIELDS
    assert all(set(r) == MANAGED_RESOURCE_FIELDS for r in extender["managedResources"])
    assert {r["name"] for r in extender["managedResources"] if not r["ignoredByScheduler"]} == NODE_RESOURCES


@pytest.mark.parametrize("version", [v for v, f in VERSIONS.items() if f != "policy"])
def test_component_config_uses_its_field_names_and_a_duration_string(rendered: Path, version: str) -> None:
    config = load_config(rendered, version)
    assert set(config) == CONFIG_TOP_LEVEL
    assert config["apiVersion"] == f"kubescheduler.config.k8s.io/{VERSIONS[version]}"
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert config["clientConnection"] == {"kubeconfig": "/etc/kubernetes/scheduler.conf"}
    assert config["leaderElection"] == {"leaderElect": True}
    (extender,) = config["extenders"]
    assert set(extender) == CONFIG_EXTENDER_FIELDS
    assert extender["enableHTTPS"] is True
    assert extender["httpTimeout"] == "15s" and GO_DURATION.match(extender["httpTimeout"])
    assert set(extender["tlsConfig"]) <= TLS_FIELDS
    assert all(set(r) == MANAGED_RESOURCE_FIELDS for r in extender["managedResources"])
    assert {r["name"] for r in extender["managedResources"] if not r["ignoredByScheduler"]} == NODE_RESOURCES


@pytest.mark.parametrize("version", [v for v, f in VERSIONS.items() if f != "policy"])
def test_the_peers_scheduler_names_are_profiles_of_the_same_scheduler(rendered: Path, version: str) -> None:
    """T9k's and KAI's pods name their own scheduler; each name is a profile beside default-scheduler,
    with no plugin changes, and the one extenders list (global to the file) serves all of them."""
    config = load_config(rendered, version)
    assert config["profiles"] == [{"schedulerName": "default-scheduler"}, {"schedulerName": "t9k-scheduler"},
                                  {"schedulerName": "kai-scheduler"}]
    assert len(config["extenders"]) == 1


def test_the_legacy_policy_warns_that_it_cannot_serve_the_peers_names(tmp_path: Path) -> None:
    run = ansible_playbook("-i", "localhost,", str(REPO / "tests/provisioning/playbooks/render-scheduler-configs.yml"),
                           "-e", json.dumps({"sandbox": str(tmp_path), "versions": ["1.16.15"]}))
    assert run.returncode == 0, run.output[-4000:]
    assert "reads the legacy Policy, which has no scheduler profiles" in run.output
    policy = json.loads((tmp_path / "1.16.15/etc/kubernetes/qgpu/scheduler-policy.json").read_text())
    assert "profiles" not in policy


@pytest.mark.parametrize("names, problem", [(["T9k-Scheduler"], "T9k-Scheduler"), ([""], '""'), ([7], "7")])
def test_a_bad_peer_scheduler_name_is_refused_with_the_rule(tmp_path: Path, names: list, problem: str) -> None:
    run = ansible_playbook("-i", "localhost,", str(REPO / "tests/provisioning/playbooks/render-scheduler-configs.yml"),
                           "-e", json.dumps({"sandbox": str(tmp_path), "versions": ["1.25.16"],
                                             "kube_scheduler_extender_peer_scheduler_names": names}))
    assert run.returncode != 0
    assert "kube_scheduler_extender_peer_scheduler_names" in run.output and problem in run.output
    assert "lower-case letters" in run.output


def test_no_peer_names_write_no_profiles(tmp_path: Path) -> None:
    run = ansible_playbook("-i", "localhost,", str(REPO / "tests/provisioning/playbooks/render-scheduler-configs.yml"),
                           "-e", json.dumps({"sandbox": str(tmp_path), "versions": ["1.25.16"],
                                             "kube_scheduler_extender_peer_scheduler_names": []}))
    assert run.returncode == 0, run.output[-4000:]
    config = yaml.safe_load((tmp_path / "1.25.16/etc/kubernetes/qgpu/kube-scheduler-config.yaml").read_text())
    assert "profiles" not in config


@pytest.mark.parametrize("version", list(VERSIONS))
def test_the_manifest_loads_exactly_the_rendered_file(rendered: Path, version: str) -> None:
    manifest = yaml.safe_load((rendered / version / "etc/kubernetes/manifests/kube-scheduler.yaml").read_text())
    args = manifest["spec"]["containers"][0]["args"]
    if VERSIONS[version] == "policy":
        assert args == ["--policy-config-file=/etc/kubernetes/qgpu/scheduler-policy.json", "--use-legacy-policy-config=true"]
    else:
        assert args == ["--config=/etc/kubernetes/qgpu/kube-scheduler-config.yaml"]
    other = "kube-scheduler-config.yaml" if VERSIONS[version] == "policy" else "scheduler-policy.json"
    assert not (rendered / version / "etc/kubernetes/qgpu" / other).exists()


@pytest.mark.parametrize("version", list(VERSIONS))
def test_tls_config_names_the_ca_and_kube_schedulers_client_certificate(rendered: Path, version: str) -> None:
    """The extender answers only a client certificate of its CA: every format carries certFile and
    keyFile next to caFile, under its own spelling of enableHTTPS, and the files are there."""
    config = load_config(rendered, version)
    (extender,) = config["extenders"]
    assert extender["enableHttps" if VERSIONS[version] == "policy" else "enableHTTPS"] is True
    assert extender["urlPrefix"].startswith("https://")
    tls = extender["tlsConfig"]
    assert {"caFile", "certFile", "keyFile"} <= set(tls)
    for path in (tls["caFile"], tls["certFile"], tls["keyFile"]):
        written = rendered / version / path.lstrip("/")
        assert written.exists() and written.stat().st_mode & 0o077 == 0, path


def test_the_role_defaults_wire_https_with_the_files_it_writes() -> None:
    defaults = yaml.safe_load((REPO / "roles/kube_scheduler_extender/defaults/main.yml").read_text())
    assert defaults["kube_scheduler_extender_enable_https"] is True
    assert defaults["kube_scheduler_extender_url_prefix"].startswith("https://")
    assert set(defaults["kube_scheduler_extender_tls"]) == {"caFile", "certFile", "keyFile"}


def test_a_rotated_client_certificate_restarts_kube_scheduler(tmp_path: Path) -> None:
    """kube-scheduler reads its extender certificates at start only: new files must change the
    static pod (its checksum annotation), the same files must not."""
    def annotation(pem: str) -> str:
        run = ansible_playbook("-i", "localhost,", str(REPO / "tests/provisioning/playbooks/render-scheduler-configs.yml"),
                               "-e", json.dumps({"sandbox": str(tmp_path), "versions": ["1.25.16"], "client_cert_pem": pem}))
        assert run.returncode == 0, run.output[-4000:]
        manifest = yaml.safe_load((tmp_path / "1.25.16/etc/kubernetes/manifests/kube-scheduler.yaml").read_text())
        return manifest["metadata"]["annotations"]["qgpu.io/scheduler-config-checksum"]

    first = annotation("certificate one")
    assert annotation("certificate one") == first
    assert annotation("certificate two") != first


def test_every_verb_the_role_wires_by_default_is_one_the_extender_serves() -> None:
    """filter, prioritize, bind and (issue 25) preempt: a verb the extender answered with 404 would
    fail every pod that reaches it (the extender is not ignorable by default)."""
    from qgpu_runtime.extender.app import ExtenderApp
    from qgpu_runtime.extender.cache import AllocationCache
    from qgpu_runtime.model.requests import DEFAULT_LIMITS
    from qgpu_runtime.placement.policies import make_policy
    from tests.recordkeys import VERIFIER

    defaults = yaml.safe_load((REPO / "roles/kube_scheduler_extender/defaults/main.yml").read_text())
    verbs = {defaults[f"kube_scheduler_extender_{v}_verb"] for v in ("filter", "prioritize", "bind", "preempt")}
    assert "preempt" in verbs
    app = ExtenderApp(AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER), None, DEFAULT_LIMITS)
    for verb in verbs:
        assert app.handle(verb, b"{}")[0] == 400, verb  # understood, and this body is malformed


def test_a_reapply_without_the_token_keeps_the_watchers_events_identity(tmp_path: Path) -> None:
    """playbooks/control-plane.yml passes the watcher its Events token; reapply-scheduler-extender.yml
    (after a master upgrade) does not. The unit the reapply wrote dropped `--kubeconfig`, so the
    watcher, restarted, recorded no Event of the re-wirings that followed."""
    unit = tmp_path / "1.25.16/etc/systemd/system/qgpu-scheduler-wiring.service"
    kubeconfig = tmp_path / "1.25.16/etc/kubernetes/qgpu/scheduler-wiring.kubeconfig"

    def render(**extra: str) -> list[str]:
        run = ansible_playbook("-i", "localhost,", str(REPO / "tests/provisioning/playbooks/render-scheduler-configs.yml"),
                               "-e", json.dumps({"sandbox": str(tmp_path), "versions": ["1.25.16"], **extra}))
        assert run.returncode == 0, run.output[-4000:]
        (line,) = [line for line in unit.read_text().splitlines() if line.startswith("ExecStart=")]
        return shlex.split(line.removeprefix("ExecStart="))

    first = render(events_token="token-of-control-plane-run")
    assert first[first.index("--kubeconfig") + 1] == str(kubeconfig)
    assert yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"] == "token-of-control-plane-run"
    assert render() == first  # the reapply: same unit, so the watcher is not restarted without its identity
    assert yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"] == "token-of-control-plane-run"
    kubeconfig.unlink()
    assert "--kubeconfig" not in render()  # no identity was ever written: the watcher only logs
