"""`qgpu validate`: lint manifests offline with the webhook's own rules."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qgpu_runtime.cli import main
from qgpu_runtime.validate_cmd import MAX_EXPANDED_NODES, UnreadableInput, validate_text

GOOD = """
apiVersion: v1
kind: Pod
metadata: {name: good}
spec:
  containers:
  - name: a
    resources: {limits: {tencent.com/vcuda-core: "50", tencent.com/vcuda-memory: "8"}}
"""

BAD_WORKLOADS = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  template:
    metadata: {annotations: {tke.cloud.tencent.com/app-class: online}}
    spec:
      containers:
      - name: a
        resources: {limits: {tke.cloud.tencent.com/qgpu-core: "30", tke.cloud.tencent.com/qgpu-memory: "2"}}
---
apiVersion: batch/v1
kind: CronJob
metadata: {name: nightly}
spec:
  jobTemplate:
    spec:
      template:
        spec:
          containers:
          - name: train
            resources: {limits: {nvidia.com/gpu: "1.5"}}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: ignored}
"""


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "validate", *args], capture_output=True, text=True, input=stdin)


def test_valid_manifest_exits_0(tmp_path):
    f = tmp_path / "good.yaml"
    f.write_text(GOOD)
    out = run(str(f))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 object(s) checked, 0 errors" in out.stderr


def test_every_error_with_kind_name_and_container_then_exit_1(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(BAD_WORKLOADS)
    out = run(str(f))
    assert out.returncode == 1
    assert out.stdout.splitlines() == [
        f"{f}: Deployment/web: container 'a': tke.cloud.tencent.com/qgpu-core=30: online pods request memory only (tke.cloud.tencent.com/qgpu-memory)",
        f"{f}: CronJob/nightly: container 'train': nvidia.com/gpu=1.5: fractions are not allowed; nvidia.com/gpu counts whole cards",
    ]


def test_json_from_stdin():
    pod = '{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "j"}, "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": -1}}}]}}'
    out = run("-", stdin=pod)
    assert out.returncode == 1
    assert "<stdin>: Pod/j: container 'c': nvidia.com/gpu=-1: must be positive; nvidia.com/gpu counts whole cards" in out.stdout


def test_a_charts_cpu_only_variant_with_zero_gpus_passes(tmp_path):
    """Helm charts render ``nvidia.com/gpu: 0`` for their CPU-only variant: the apiserver accepts
    it, and so does ``qgpu validate`` (issue 22 §1)."""
    f = tmp_path / "cpu.yaml"
    f.write_text("kind: Deployment\nmetadata: {name: web}\nspec:\n  template:\n    spec:\n      containers:\n"
                 "      - name: web\n        resources: {limits: {nvidia.com/gpu: \"0\", tencent.com/vcuda-core: 0}}\n"
                 "      initContainers:\n      - name: init\n        resources: {limits: {nvidia.com/gpu: 0}}\n")
    out = run(str(f))
    assert out.returncode == 0, out.stdout + out.stderr


def test_unparsable_yaml_exits_3_naming_the_file_and_line(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("kind: Pod\n  bad: [\n")
    out = run(str(f))
    assert out.returncode == 3
    assert out.stderr.splitlines()[0].startswith(f"qgpu validate: {f}:2: not valid YAML/JSON")


def test_missing_file_exits_3(tmp_path):
    out = run(str(tmp_path / "none.yaml"))
    assert out.returncode == 3
    assert out.stderr.splitlines()[0] == f"qgpu validate: {tmp_path / 'none.yaml'}: cannot read: No such file or directory"


def test_a_directory_exits_3(tmp_path):
    out = run(str(tmp_path))
    assert out.returncode == 3
    assert out.stderr.splitlines()[0] == f"qgpu validate: {tmp_path}: cannot read: Is a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_file_exits_3(tmp_path):
    f = tmp_path / "secret.yaml"
    f.write_text(GOOD)
    f.chmod(0)
    out = run(str(f))
    assert out.returncode == 3
    assert out.stderr.splitlines()[0] == f"qgpu validate: {f}: cannot read: Permission denied"


def test_a_binary_file_is_one_line_and_exit_3(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe" + bytes(range(256)))
    out = run(str(f))
    assert out.returncode == 3
    assert out.stderr.splitlines()[0] == f"qgpu validate: {f}: not UTF-8 text (byte 0xff at offset 8); a binary file?"
    assert "Traceback" not in out.stderr


def test_an_impossible_date_is_a_parse_error_not_a_traceback(tmp_path):
    f = tmp_path / "date.yaml"
    f.write_text("kind: Pod\nmetadata: {name: d, annotations: {when: 2024-13-45}}\n")
    out = run(str(f))
    assert out.returncode == 3 and "not valid YAML/JSON" in out.stderr and "Traceback" not in out.stderr


def test_other_files_are_still_checked_after_an_unreadable_one(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_WORKLOADS)
    out = run(str(tmp_path / "none.yaml"), str(bad))
    assert out.returncode == 3 and len(out.stdout.splitlines()) == 2
    assert out.stderr.splitlines()[-1] == "2 object(s) checked, 2 errors, 1 file(s) unreadable"


def test_help_documents_the_exit_codes():
    out = run("--help")
    assert "exit status:" in out.stdout
    assert "3  a file could not be read or parsed" in out.stdout


def laughs(levels: int, fanout: int, leaf: str) -> str:
    """A "billion laughs" document: fanout**levels copies of ``leaf`` in a few hundred bytes."""
    lines = [f"l0: &l0 {leaf}"]
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} {{kind: List, items: [{', '.join([f'*l{i - 1}'] * fanout)}]}}")
    lines.append(f"kind: List\nitems: [*l{levels}]")
    return "\n".join(lines)


def test_an_alias_bomb_is_refused_before_it_is_walked():
    """10**12 pods: walking them would never finish, so returning at all shows the bound."""
    with pytest.raises(UnreadableInput, match=f"aliases expand to more than {MAX_EXPANDED_NODES} nodes"):
        validate_text(laughs(12, 10, "{kind: Pod, metadata: {name: p}, spec: {containers: [{name: c}]}}"), "bomb.yaml")


def test_an_alias_bomb_file_exits_3(tmp_path):
    f = tmp_path / "bomb.yaml"
    f.write_text(laughs(9, 9, "lol"))
    out = run(str(f))
    assert out.returncode == 3 and "alias bomb" in out.stderr.splitlines()[0]


def test_a_recursive_alias_is_refused():
    with pytest.raises(UnreadableInput, match="alias \\*a refers to a node that contains it"):
        validate_text("a: &a {kind: List, items: [*a]}", "loop.yaml")


def test_aliases_within_the_bound_still_work():
    text = "x: &c {name: c, resources: {limits: {nvidia.com/gpu: 9}}}\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [*c, *c]}"
    findings, checked = validate_text(text, "ok.yaml")
    assert checked == 1 and [f.message for f in findings] == [
        "container 'c': nvidia.com/gpu=9: no node could ever hold it: at most 8 cards per node"] * 2


def test_permission_denied_is_one_line(tmp_path, monkeypatch, capsys):
    """Run as root the file mode test above cannot deny; the OS's answer is simulated here."""
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr("builtins.open", denied)
    assert main(["validate", str(tmp_path / "secret.yaml")]) == 3
    assert capsys.readouterr().err.splitlines()[0] == f"qgpu validate: {tmp_path / 'secret.yaml'}: cannot read: Permission denied"


@pytest.mark.parametrize("manifest,message", [
    ("kind: Pod\nmetadata: {name: p}\nspec: {containers: 5}", "pod.spec.containers=5: must be a list of objects"),
    ("kind: Pod\nmetadata: [p]\nspec: {containers: [{name: c}]}", "pod.metadata=['p']: must be an object"),
    ("kind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, resources: {limits: {1: 2}}}]}",
     "pod.spec.containers[0].resources.limits[1]=2: keys must be strings"),
])
def test_wrong_typed_manifests_are_findings_not_tracebacks(tmp_path, manifest, message):
    f = tmp_path / "odd.yaml"
    f.write_text(manifest)
    out = run(str(f))
    assert out.returncode == 1, out.stderr
    assert out.stdout.splitlines() == [f"{f}: Pod/{'p' if 'metadata: {' in manifest else '<unnamed>'}: {message}"]


def test_a_list_kind_that_is_not_a_string_is_skipped():
    assert validate_text("kind: 5\nitems: []", "odd.yaml") == ([], 0)
