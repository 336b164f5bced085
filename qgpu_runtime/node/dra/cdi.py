"""CDI specs for prepared ResourceClaims: one JSON file per claim in the runtime's CDI folder.

The DRA kubelet plugin answers kubelet with fully qualified CDI device IDs
(``gpu.qgpu.io/claim=<name>``); kubelet passes them to the runtime through the CRI, and the runtime
(containerd ≥ 2.0, CRI-O) looks them up in its ``cdi_spec_dirs`` and applies their container edits.
A runtime without CDI ignores the IDs silently (docs/dra.md), which is why the edits carry nothing
the pod cannot live without except the card itself.

Files are written atomically (temporary file in the same folder, fsync, rename): the runtime may
scan the folder at any moment and must never read half a spec. The temporary file is removed on
any failure of the write, and a kill between its creation and the rename (nothing can clean up
then) is repaired at the next start: :func:`remove_stale_temporaries` deletes the files of
qgpu's own temporary pattern, and no other file of the folder (it is shared with other vendors).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from qgpu_runtime.contract.dra import DRIVER
from qgpu_runtime.contract.environment import (
    CONTROL_DEVICES,
    DEVICE_LIST_MOUNT_SOURCE,
    T9kMode,
    container_environment,
    device_list_mounts,
)
from qgpu_runtime.contract.record import CardShare, ContainerDialect
from qgpu_runtime.gpu.types import CardInfo

CDI_VERSION = "0.6.0"
CLASS = "claim"
KIND = f"{DRIVER}/{CLASS}"
DEFAULT_DIR = Path("/var/run/cdi")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_TEMPORARY = re.compile(r"^\.%s-%s_[^/]+\.json\.tmp[0-9]+$" % (re.escape(DRIVER), re.escape(CLASS)))
"""``.<spec name>.tmp<pid>``: what :func:`write_spec` names its temporary files, and only those."""


@dataclass(frozen=True)
class CdiDevice:
    """One CDI device: the environment, device nodes and card mounts a container gets for one
    claim result. ``cards``: the UUIDs of the result's own card(s), each named to the toolkit by a
    mount (contract/environment.py ``device_list_mounts``)."""

    name: str
    env: Mapping[str, str]
    device_nodes: tuple[str, ...]
    cards: tuple[str, ...]

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"CDI device name {self.name!r} is not allowed: letters, digits and _.:- only")


def claim_devices(uid: str, shares: Sequence[CardShare], cards: Mapping[int, CardInfo], klass: str, policy: str,
                  device_nodes: Callable[[int], tuple[str, ...]], asked: ContainerDialect | None = None) -> list[CdiDevice]:
    """One CDI device per result of claim ``uid``. Every device carries the claim's whole
    environment (contract/environment.py: all its cards, in result order, and one class: the
    isolation loop's for a tenant of mixed classes): a container given the claim gets all of
    them, and identical edits cannot conflict. ``device_nodes(card index)``: what each adds.
    ``asked``: the dialect the webhook wrote into the claim's ShareConfig (T9k's whole node, HAMi,
    KAI), whose variables the container gets as on the device-plugin path; without it the T9k
    variables follow the shares."""
    t9k = T9kMode.of_dialect(asked) if asked is not None else T9kMode.of_shares(shares, {i: c.memory_mib for i, c in cards.items()})
    env = container_environment(shares, klass, policy, t9k, asked)
    return [CdiDevice(f"{uid}-{i}", env, device_nodes(s.index), (s.uuid,)) for i, s in enumerate(shares)]


def card_device_nodes(card: CardInfo, device_exists: Callable[[str], bool]) -> tuple[str, ...]:
    """The card's and the driver's device nodes, only those the host has: a runtime fails the
    container on a device node it cannot find (docs/dra.md)."""
    wanted = (f"/dev/nvidia{card.minor}", *CONTROL_DEVICES)
    return tuple(p for p in wanted if device_exists(p))


def device_id(name: str) -> str:
    """The fully qualified CDI ID kubelet hands the runtime: ``gpu.qgpu.io/claim=<name>``."""
    return f"{KIND}={name}"


def spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    """One file per claim, named after its UID (the vendor-class_name.json convention). The UID
    comes from kubelet's call, before any check against the apiserver: ValueError unless it is
    what the apiserver writes (letters, digits and ``-``; at most 128), so no name built from it
    leaves the CDI folder."""
    if not _UID.fullmatch(claim_uid):
        raise ValueError(f"claim UID {claim_uid[:140]!r}: must be 1 to 128 ASCII letters, digits or '-' "
                         "(a Kubernetes UID)")
    return Path(cdi_dir) / f"{DRIVER}-{CLASS}_{claim_uid}.json"


_UID = re.compile(r"[0-9A-Za-z-]{1,128}")


# How the runtime mounts /dev/null at each card's path: a read-only bind, as the toolkit expects.
CARD_MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")


def spec(devices: Sequence[CdiDevice]) -> dict[str, Any]:
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [{
            "name": d.name,
            "containerEdits": {
                "env": [f"{k}={v}" for k, v in sorted(d.env.items())],
                **({"deviceNodes": [{"path": p} for p in d.device_nodes]} if d.device_nodes else {}),
                **({"mounts": [{"hostPath": DEVICE_LIST_MOUNT_SOURCE, "containerPath": p, "options": list(CARD_MOUNT_OPTIONS)}
                               for p in device_list_mounts(d.cards)]} if d.cards else {}),
            },
        } for d in devices],
    }


def write_spec(path: Path, document: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        try:
            tmp.unlink()  # only still there when the write failed before its rename
        except FileNotFoundError:
            pass


def remove_stale_temporaries(cdi_dir: Path) -> list[Path]:
    """Remove the temporary files a killed writer left (qgpu's pattern only); returns them.

    Called once at the plugin's start, before any write of this process: the node runs one qgpu
    DRA plugin, so no other writer of these names can be half-way."""
    removed = []
    try:
        entries = list(os.scandir(cdi_dir))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if _TEMPORARY.match(entry.name) and entry.is_file(follow_symlinks=False):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed.append(Path(entry.path))
    return removed


def read_spec(path: Path) -> dict[str, Any] | None:
    """The spec at ``path``; None when absent or unreadable (a repair rewrites it)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def remove_spec(path: Path) -> None:
    """Remove a claim's spec; an absent one is fine (unprepared before, or never written)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
