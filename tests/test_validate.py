"""`qgpu validate`: lint manifests offline with the webhook's own rules."""

from __future__ import annotations

import subprocess
import sys

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
    pod = '{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "j"}, "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 0}}}]}}'
    out = run("-", stdin=pod)
    assert out.returncode == 1
    assert "<stdin>: Pod/j: container 'c': nvidia.com/gpu=0: must be positive; nvidia.com/gpu counts whole cards" in out.stdout


def test_unparsable_yaml_exits_2(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("kind: Pod\n  bad: [\n")
    out = run(str(f))
    assert out.returncode == 2
    assert "not valid YAML/JSON" in out.stderr


def test_missing_file_exits_2(tmp_path):
    out = run(str(tmp_path / "none.yaml"))
    assert out.returncode == 2 and "cannot read" in out.stderr
