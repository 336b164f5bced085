"""The kubelet protos compile into a cache keyed by their content, never into the source tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_protos_compile_into_the_configured_cache(tmp_path):
    code = ("from qgpu_runtime import protos; p = protos.build(); print(p); "
            "api = protos.deviceplugin(); print(api.pb2.DESCRIPTOR.package, len(api.pb2.DESCRIPTOR.services_by_name))")
    env = {"QGPU_PROTO_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=REPO).stdout.split("\n")
    assert out[0].startswith(str(tmp_path)) and (tmp_path / out[0].rsplit("/", 1)[1] / "done").exists()
    assert out[1] == "v1beta1 2"
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert again.split("\n")[0] == out[0]  # reused, not rebuilt
