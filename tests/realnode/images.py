"""The two images the local cluster needs besides qgpu's own: the pod sandbox (``pause``) and
kube-scheduler, which runs as a static pod of the kubelet exactly as kubeadm runs it, so the
``kube_scheduler_extender`` role rewires a real manifest.

Both are single static binaries written into an OCI archive by the same module that builds qgpu's
runtime image (roles/qgpu_image/library/qgpu_oci_archive.py), cached by the digest of their input.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ASSETS = Path(__file__).resolve().parent / "assets"
PAUSE_REF = "localhost/qgpu/pause:3.10"
OCI_MODULE_DIR = ROOT / "roles" / "qgpu_image" / "library"


def kube_scheduler_ref(version: str = os.environ.get("QGPU_K8S_VERSION", "v1.37.2")) -> str:
    return f"localhost/qgpu/kube-scheduler:{version}"


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def _archive(cache: Path, name: str, tree: Path, ref: str, key: str, entrypoint: list[str]) -> Path:
    dest = cache / f"{name}.oci.tar"
    args = {"dest": str(dest), "reference": ref, "inputs_key": key,
            "trees": [{"src": str(tree), "dest": "/", "owner": "root"}],
            "config": {"entrypoint": entrypoint}}
    ansible = Path(sys.executable).parent / "ansible"
    out = subprocess.run([str(ansible), "localhost", "-c", "local", "-i", "localhost,", "-M", str(OCI_MODULE_DIR),
                          "-m", "qgpu_oci_archive", "-a", json.dumps(args),
                          "-e", f"ansible_python_interpreter={sys.executable}"],
                         capture_output=True, text=True, env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")})
    if out.returncode != 0:
        raise RuntimeError(f"writing the {name} image failed:\n{out.stdout}\n{out.stderr}")
    return dest


def pause_image(cache: Path) -> Path:
    """A static ``pause`` (assets/pause.c, compiled here with gcc -static)."""
    source = ASSETS / "pause.c"
    key = _digest(source)
    tree = cache / f"pause-{key}"
    if not (tree / "pause").exists():
        tmp = tree.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        subprocess.run(["gcc", "-static", "-Os", "-s", "-o", str(tmp / "pause"), str(source)], check=True)
        shutil.rmtree(tree, ignore_errors=True)
        tmp.rename(tree)
    return _archive(cache, "pause", tree, PAUSE_REF, key, ["/pause"])


def kube_scheduler_image(cache: Path, k8s_bin: Path) -> Path:
    """The kube-scheduler binary of scripts/k8s-testbin (static: CGO_ENABLED=0) in an image."""
    binary = k8s_bin / "kube-scheduler"
    key = _digest(binary)
    tree = cache / f"kube-scheduler-{key}"
    target = tree / "usr" / "local" / "bin" / "kube-scheduler"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(binary, target)
    return _archive(cache, "kube-scheduler", tree, kube_scheduler_ref(), key, ["/usr/local/bin/kube-scheduler"])
