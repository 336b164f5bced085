"""Kubelet gRPC APIs (device plugin v1beta1, pod-resources v1, plugin registration v1, DRA v1,
DRA resource health v1), compiled on first use.

The .proto files in this folder are the source; generated Python is never committed. On first
import the protos are compiled with grpcio-tools into a cache folder keyed by the protos' hash, so
an edited proto is recompiled and a stale build is never imported. ``python -m qgpu_runtime.protos``
does the same ahead of time (image builds, bootstrap).

Cache folder, first writable of: ``$QGPU_PROTO_CACHE``, ``<package>/protos/_generated`` (git-ignored),
``$XDG_CACHE_HOME/qgpu/protos`` (or ``~/.cache/qgpu/protos``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ("deviceplugin_v1beta1", "podresources_v1", "pluginregistration_v1", "dra_v1", "dra_health_v1")
_MODULE_PREFIX = "qgpu_protos_"
_lock = threading.Lock()
_loaded: dict[str, "Api"] = {}


@dataclass(frozen=True)
class Api:
    """One compiled proto: ``pb2`` holds the messages, ``grpc`` the stubs and servicers."""

    pb2: ModuleType
    grpc: ModuleType


class ProtoBuildError(RuntimeError):
    """The protos could not be compiled; the message carries protoc's own output."""


def _digest() -> str:
    h = hashlib.sha256()
    for name in PROTOS:
        h.update((PROTO_DIR / f"{name}.proto").read_bytes())
    import grpc_tools

    h.update(getattr(grpc_tools, "__file__", "").encode())
    return h.hexdigest()[:16]


def _cache_roots() -> list[Path]:
    roots = []
    if os.environ.get("QGPU_PROTO_CACHE"):
        roots.append(Path(os.environ["QGPU_PROTO_CACHE"]))
    roots.append(PROTO_DIR / "_generated")
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    roots.append(Path(xdg) / "qgpu" / "protos")
    return roots


def _compile_into(target: Path) -> None:
    from grpc_tools import protoc

    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    for name in PROTOS:
        # Copy under a prefixed name so the generated top-level modules cannot collide with anyone's.
        (tmp / f"{_MODULE_PREFIX}{name}.proto").write_bytes((PROTO_DIR / f"{name}.proto").read_bytes())
    for name in PROTOS:
        args = ["grpc_tools.protoc", f"-I{tmp}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                str(tmp / f"{_MODULE_PREFIX}{name}.proto")]
        if protoc.main(args) != 0:
            raise ProtoBuildError(f"protoc failed on {name}.proto (args {args[1:]})")
    try:
        tmp.rename(target)  # atomic publish: concurrent builders race harmlessly
    except OSError:
        if not (target / "done").exists():
            raise
    else:
        (target / "done").write_text("ok\n")


def build() -> Path:
    """Compile the protos if needed and return the folder holding the generated modules."""
    digest = _digest()
    errors = []
    for root in _cache_roots():
        target = root / digest
        if (target / "done").exists():
            return target
        try:
            root.mkdir(parents=True, exist_ok=True)
            _compile_into(target)
            return target
        except OSError as exc:
            errors.append(f"{root}: {exc}")
    raise ProtoBuildError("no writable folder for generated protos: " + "; ".join(errors))


def _import(path: Path, module_name: str) -> ModuleType:
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ProtoBuildError(f"cannot import generated module {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # the _grpc module imports the _pb2 one by this name
    spec.loader.exec_module(module)
    return module


def load(name: str) -> Api:
    """The compiled API ``name`` (one of PROTOS), building it on first use."""
    if name not in PROTOS:
        raise KeyError(f"proto {name!r} is unknown; known: {', '.join(PROTOS)}")
    with _lock:
        if name not in _loaded:
            folder = build()
            base = f"{_MODULE_PREFIX}{name}"
            pb2 = _import(folder / f"{base}_pb2.py", f"{base}_pb2")
            stubs = _import(folder / f"{base}_pb2_grpc.py", f"{base}_pb2_grpc")
            _loaded[name] = Api(pb2, stubs)
        return _loaded[name]


def deviceplugin() -> Api:
    return load("deviceplugin_v1beta1")


def podresources() -> Api:
    return load("podresources_v1")


def pluginregistration() -> Api:
    """kubelet's plugin watcher: ``Registration`` (GetInfo, NotifyRegistrationStatus)."""
    return load("pluginregistration_v1")


def dra() -> Api:
    """The ``v1.DRAPlugin`` service (NodePrepareResources, NodeUnprepareResources)."""
    return load("dra_v1")


def dra_health() -> Api:
    """The ``v1.DRAResourceHealth`` service (NodeWatchResources), optional beside ``v1.DRAPlugin``."""
    return load("dra_health_v1")
