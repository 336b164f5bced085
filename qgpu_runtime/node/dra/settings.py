"""Where the DRA door lives on the node: its sockets, the CDI folder, whether device nodes are passed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qgpu_runtime.contract.dra import DRIVER
from qgpu_runtime.node.dra import cdi


@dataclass(frozen=True)
class DraSettings:
    node: str
    kubelet_plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    plugins_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    cdi_dir: Path = cdi.DEFAULT_DIR
    pass_device_specs: bool = True

    @property
    def dra_socket(self) -> Path:
        return (self.kubelet_plugins_dir / DRIVER / "dra.sock").absolute()

    @property
    def registration_socket(self) -> Path:
        return (self.plugins_registry_dir / f"{DRIVER}-reg.sock").absolute()
