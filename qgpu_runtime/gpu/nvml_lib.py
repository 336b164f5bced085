"""The one module that imports pynvml (nvidia-ml-py): loading NVML and its stateless queries.

NVML is a boundary this project does not own. Everything that talks to the driver goes through
``qgpu_runtime.gpu``: this module loads the library and answers what needs no state (the cards,
the CUDA driver version); gpu/nvml_processes.py samples GPU processes; gpu/nvml.py is the node
manager's backend (discovery, metrics samples, XID health events). Other modules are handed the
loaded module (or a fake of it in tests) and never import pynvml themselves
(tests/node/test_node_nvml.py checks that).

NVML failing is an error the operator must see, never a silent switch to simulated cards.
"""

from __future__ import annotations

from typing import Any

from qgpu_runtime.gpu.types import BackendError, CardInfo

MIB = 1024 * 1024


class NvmlUnavailable(BackendError):
    """NVML could not be loaded or queried; the message says which call failed and why."""


def load_nvml() -> Any:
    """pynvml, initialised. Raises :class:`NvmlUnavailable` naming the failing step."""
    try:
        import pynvml
    except ImportError as err:  # nvidia-ml-py is a dependency; a broken install is still possible
        raise NvmlUnavailable(f"import pynvml (package nvidia-ml-py): {err}") from err
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlUnavailable(f"NVML init failed: nvmlInit: {err}; is the NVIDIA driver loaded and /dev/nvidia* "
                              "visible? (use --gpu-backend simulated only on purpose, for hosts without GPUs)") from err
    return pynvml


def text(value: object) -> str:
    """NVML strings are bytes in older nvidia-ml-py releases and str in newer ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def list_cards(nv: Any) -> tuple[CardInfo, ...]:
    """Every card NVML sees, in index order. Raises :class:`NvmlUnavailable` naming the card."""
    cards: list[CardInfo] = []
    try:
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            cards.append(CardInfo(
                index=index,
                uuid=text(nv.nvmlDeviceGetUUID(handle)),
                model=text(nv.nvmlDeviceGetName(handle)),
                memory_mib=int(nv.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
                minor=int(nv.nvmlDeviceGetMinorNumber(handle)),
            ))
    except nv.NVMLError as err:
        raise NvmlUnavailable(f"NVML discovery failed at card {len(cards)}: {err}") from err
    return tuple(cards)


def cuda_driver_version(nv: Any) -> int:
    """CUDA version the driver supports, as NVML encodes it (11050 = 11.5)."""
    return int(nv.nvmlSystemGetCudaDriverVersion_v2())
