"""The runtime image, built by the provisioning itself (playbooks/image.yml, role qgpu_image).

The playbook runs for real on this machine as both controller and node: debootstrap builds the
base (cached under .cache/image, so the suite pays it once per machine), pip installs qgpu's
dependencies for the image's Python, the role writes the OCI archive and imports it into a real
containerd (Debian's 1.6, on a private socket and root under a temporary directory). The image
then runs `qgpu --version` and `id -u` under `ctr run`. Only the registry is faked (no registry
is reachable here): a stand-in skopeo records the command the role renders.

Needs: apt-get install -y --no-install-recommends debootstrap containerd runc (and root).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import shutil
import signal
import subprocess
import tarfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from ansible_tools import REPO, Run, ansible_playbook

PLAYBOOK = "playbooks/image.yml"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
REFERENCE = f"localhost/qgpu/qgpu-runtime:{VERSION}"
NAMESPACE = "k8s.io"

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Containerd:
    """A private containerd: its socket and a ctr bound to it."""

    address: str

    def ctr(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ctr", "--address", self.address, "--namespace", NAMESPACE, *args],
                              capture_output=True, text=True, timeout=300, check=False)


@dataclass(frozen=True)
class Builds:
    """The first and second run of the playbook against the same node."""

    first: Run
    second: Run
    inventory: Path

    @property
    def archive(self) -> Path:
        return built_archive(self.first)


def require_tools() -> None:
    missing = [tool for tool in ("debootstrap", "containerd", "ctr", "runc") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"missing {missing}: apt-get install -y --no-install-recommends debootstrap containerd runc")


@pytest.fixture(scope="module")
def containerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Containerd]:
    require_tools()
    home = tmp_path_factory.mktemp("containerd")
    address = str(home / "containerd.sock")
    # The CRI plugin is off: `ctr run` does not need it (and without CAP_SYS_RESOURCE it would
    # need restrict_oom_score_adj).
    (home / "config.toml").write_text(
        f'version = 2\nroot = "{home}/root"\nstate = "{home}/state"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{address}"\n[ttrpc]\n  address = "{address}.ttrpc"\n')
    log = open(home / "containerd.log", "w")
    daemon = subprocess.Popen(["containerd", "--config", str(home / "config.toml")], stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    runtime = Containerd(address)
    try:
        ready = subprocess.run(["ctr", "--address", address, "--connect-timeout", "30s", "version"],
                               capture_output=True, text=True, timeout=60, check=False)
        assert ready.returncode == 0, (home / "containerd.log").read_text()[-3000:]
        yield runtime
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
        log.close()
        subprocess.run(["umount", "-R", str(home / "state")], capture_output=True, check=False)


@pytest.fixture(scope="module")
def builds(containerd: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Builds:
    """Build and import (the first run may pay debootstrap), then the same playbook again."""
    work = tmp_path_factory.mktemp("image-node")
    inventory = work / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"qgpu_gpu_nodes": {"hosts": {"localhost": {
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "qgpu_image_containerd_address": containerd.address,
        "qgpu_image_node_dir": str(work / "node-cache"),
    }}}}}}))
    first = ansible_playbook("-i", str(inventory), PLAYBOOK, timeout=1800)
    assert first.returncode == 0, first.output[-6000:]
    second = ansible_playbook("-i", str(inventory), PLAYBOOK)
    assert second.returncode == 0, second.output[-6000:]
    return Builds(first, second, inventory)


def built_archive(run: Run) -> Path:
    """The archive the role reports ("Report the image"): it lives under its inputs key."""
    match = re.search(r'^\s+"?archive"?: "?([^"\s,]+)', run.output, re.MULTILINE)
    assert match, run.output[-3000:]
    return Path(match.group(1))


def remove_archive(archive: Path) -> None:
    """Drop an archive a test built for another reference (and its key directory)."""
    shutil.rmtree(archive.parent, ignore_errors=True)


def base_dir(key: str) -> Path:
    """The role's cache entry for a base key (vars/main.yml: the key's sha256, 16 hex digits)."""
    return REPO / ".cache/image/base" / hashlib.sha256(key.encode()).hexdigest()[:16]


def read_archive(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {member.name: tar.extractfile(member).read() for member in tar.getmembers() if member.isfile()}


def blob(files: dict[str, bytes], digest: str) -> bytes:
    return files["blobs/sha256/" + digest.removeprefix("sha256:")]


def task_result(run: Run, task: str) -> str:
    """The status line (ok/changed/skipping) that follows a task's banner."""
    match = re.search(rf"TASK \[[^\]]*{re.escape(task)}\].*?\n(?:.*\n)*?(ok|changed|skipping|fatal)[:\s]", run.output)
    assert match, f"task {task!r} not in the output"
    return match.group(1)


def test_archive_is_an_oci_layout_with_every_blob_matching_its_digest(builds: Builds) -> None:
    files = read_archive(builds.archive)
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    [entry] = index["manifests"]
    assert entry["annotations"] == {"io.containerd.image.name": REFERENCE, "org.opencontainers.image.ref.name": VERSION}
    manifest = json.loads(blob(files, entry["digest"]))
    [layer] = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    for descriptor in (entry, manifest["config"], layer):
        data = blob(files, descriptor["digest"])
        assert ("sha256:" + hashlib.sha256(data).hexdigest(), len(data)) == (descriptor["digest"], descriptor["size"])
    config = json.loads(blob(files, manifest["config"]["digest"]))
    uncompressed = gzip.decompress(blob(files, layer["digest"]))
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(uncompressed).hexdigest()]


def test_layer_is_sorted_with_fixed_times_and_numeric_owners(builds: Builds) -> None:
    files = read_archive(builds.archive)
    manifest = json.loads(blob(files, json.loads(files["index.json"])["manifests"][0]["digest"]))
    with tarfile.open(fileobj=gzip.GzipFile(fileobj=io.BytesIO(blob(files, manifest["layers"][0]["digest"])))) as layer:
        members = {m.name: m for m in layer.getmembers()}
        names = [m.name for m in layer.getmembers()]
    assert names == sorted(names)
    assert {m.mtime for m in members.values()} == {0}
    assert {(m.uname, m.gname) for m in members.values()} == {("", "")}
    assert (members["home/qgpu"].uid, members["home/qgpu"].gid) == (65532, 65532)
    assert members["usr/local/bin/qgpu"].mode & 0o111
    assert not any(name.startswith(("dev/", "proc/", "var/lib/apt/lists/")) for name in names)


def test_rewriting_the_archive_from_the_same_inputs_gives_the_same_digest(builds: Builds) -> None:
    sidecar = Path(f"{builds.archive}.json")
    before = json.loads(sidecar.read_text())["manifest_digest"]
    sidecar.unlink()
    run = ansible_playbook("-i", str(builds.inventory), PLAYBOOK)
    assert run.returncode == 0, run.output[-6000:]
    assert task_result(run, "Write the OCI image archive") == "changed"
    assert built_archive(run) == builds.archive
    assert json.loads(sidecar.read_text())["manifest_digest"] == before


def test_first_run_imports_the_image_into_containerd(builds: Builds, containerd: Containerd) -> None:
    digest = json.loads(Path(f"{builds.archive}.json").read_text())["manifest_digest"]
    listed = containerd.ctr("images", "list", f"name=={REFERENCE}")
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[:3] for line in listed.stdout.splitlines()[1:]] == [
        [REFERENCE, "application/vnd.oci.image.manifest.v1+json", digest]]


def test_second_run_changes_nothing_and_skips_the_import(builds: Builds) -> None:
    assert builds.second.recap_changed() == 0, builds.second.output[-4000:]
    assert task_result(builds.second, "Import the archive into containerd") == "skipping"


def test_image_runs_the_qgpu_command_of_this_checkout(builds: Builds, containerd: Containerd) -> None:
    ran = containerd.ctr("run", "--rm", REFERENCE, "qgpu-version", "qgpu", "--version")
    assert (ran.returncode, ran.stdout.strip()) == (0, f"qgpu {VERSION}"), ran.stderr


def test_image_runs_as_the_non_root_user_by_default(builds: Builds, containerd: Containerd) -> None:
    ran = containerd.ctr("run", "--rm", REFERENCE, "qgpu-id", "id")
    assert (ran.returncode, ran.stdout.strip()) == (0, "uid=65532(qgpu) gid=65532(qgpu) groups=65532(qgpu)"), ran.stderr


def test_registry_set_pushes_the_archive_with_skopeo_instead_of_importing(builds: Builds, tmp_path: Path) -> None:
    """No registry is reachable here: a stand-in skopeo records its arguments; `inspect` finds nothing."""
    calls = tmp_path / "calls.jsonl"
    skopeo = tmp_path / "skopeo"
    skopeo.write_text("#!/usr/bin/env python3\nimport json, sys\n"
                      f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                      "sys.exit(1 if sys.argv[1] == 'inspect' else 0)\n")
    skopeo.chmod(0o755)
    pushed = f"registry.test:5000/qgpu/qgpu-runtime:{VERSION}"
    run = ansible_playbook("-i", str(builds.inventory), PLAYBOOK, "-e", json.dumps({
        "qgpu_image_registry": "registry.test:5000", "qgpu_image": pushed, "qgpu_image_skopeo": str(skopeo),
        "qgpu_image_registry_auth_file": "/etc/qgpu/registry-auth.json"}))
    try:
        assert run.returncode == 0, run.output[-6000:]
        archive = built_archive(run)
        assert archive.name == f"registry.test_5000_qgpu_qgpu-runtime_{VERSION}-amd64.oci.tar"
        recorded = [json.loads(line) for line in calls.read_text().splitlines()]
        # the credentials by file, never on the command line (readable in /proc by every local user)
        assert recorded == [["inspect", "--raw", "--authfile", "/etc/qgpu/registry-auth.json", f"docker://{pushed}"],
                            ["copy", "--preserve-digests", "--dest-authfile", "/etc/qgpu/registry-auth.json",
                             f"oci-archive:{archive}", f"docker://{pushed}"]]
        assert task_result(run, "Import the image into this node's containerd") == "skipping"
        assert '"pushed": true' in run.output  # cluster.yml then names it by digest in the pod templates
    finally:
        if run.returncode == 0:
            remove_archive(built_archive(run))


def test_a_qgpu_image_other_than_the_build_fails_naming_both(builds: Builds) -> None:
    run = ansible_playbook("-i", str(builds.inventory), PLAYBOOK, "-e", "qgpu_image=example.org/other:1")
    assert run.returncode != 0
    assert 'qgpu_image "example.org/other:1"' in run.output and REFERENCE in run.output


def test_the_manifests_default_to_the_image_this_role_builds() -> None:
    for role in ("qgpu_scheduler", "qgpu_manager", "qgpu_webhook"):
        defaults = (REPO / "roles" / role / "defaults/main.yml").read_text()
        assert f"{role}_image: \"{{{{ qgpu_image | default('{REFERENCE}') }}}}\"" in defaults, role


def test_an_operator_base_archive_becomes_the_base(builds: Builds, containerd: Containerd, tmp_path: Path) -> None:
    """A root filesystem tar named by qgpu_image_base_archive replaces debootstrap (here: the
    cached Debian base, tarred, plus a marker file only that tar has)."""
    debian = base_dir("debootstrap bookworm minbase http://deb.debian.org/debian amd64 python3")
    base = tmp_path / "base.tar"
    subprocess.run(["tar", "--numeric-owner", "--sort=name", "-cf", str(base), "-C", str(debian), "."], check=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/qgpu-base-marker").write_text("operator base\n")
    subprocess.run(["tar", "--numeric-owner", "-rf", str(base), "-C", str(tmp_path), "./etc/qgpu-base-marker"], check=True)
    tag = "operator-base"
    run = ansible_playbook("-i", str(builds.inventory), PLAYBOOK, "-e", json.dumps({
        "qgpu_image_base_archive": str(base), "qgpu_image_tag": tag}), timeout=1200)
    extracted = base_dir("archive " + hashlib.sha256(base.read_bytes()).hexdigest())
    try:
        assert run.returncode == 0, run.output[-6000:]
        ran = containerd.ctr("run", "--rm", f"localhost/qgpu/qgpu-runtime:{tag}", "qgpu-base", "cat", "/etc/qgpu-base-marker")
        assert (ran.returncode, ran.stdout) == (0, "operator base\n"), ran.stderr
    finally:
        if run.returncode == 0:
            remove_archive(built_archive(run))
        containerd.ctr("images", "rm", f"localhost/qgpu/qgpu-runtime:{tag}")
        shutil.rmtree(extracted, ignore_errors=True)
        Path(f"{extracted}.lock").unlink(missing_ok=True)
