"""Filters for wiring the qgpu extender into a kube-scheduler static pod.

Why Python and not Jinja: choosing the config format from the running version and editing the
kubeadm-generated manifest are small pure functions with many cases (every Kubernetes minor from
1.14 on, foreign flags, re-wiring after an upgrade). They live in the runtime package
(qgpu_runtime/wiring/formats.py) because the master's re-wiring watcher (`qgpu scheduler-wiring
watch`) applies the same wiring after a master upgrade: one definition of "wired" for both. The
filters take that module from this checkout (the one the roles deploy) and turn its errors into
Ansible's.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError

_CHECKOUT = str(Path(__file__).resolve().parents[3])
if _CHECKOUT not in sys.path:
    sys.path.insert(0, _CHECKOUT)

from qgpu_runtime.wiring import formats  # noqa: E402  (after the checkout is on the path)

_ansible_errors = functools.partial(formats.translated, error=AnsibleFilterError)

scheduler_config_format = _ansible_errors(formats.scheduler_config_format)
scheduler_has_dra = _ansible_errors(formats.scheduler_has_dra)
scheduler_version_from_manifest = _ansible_errors(formats.scheduler_version_from_manifest)
scheduler_wire = _ansible_errors(formats.scheduler_wire)
scheduler_unwire = _ansible_errors(formats.scheduler_unwire)
scheduler_is_wired = _ansible_errors(formats.scheduler_is_wired)
scheduler_config_file_name = _ansible_errors(formats.config_file_name)
scheduler_restart_checksum = _ansible_errors(formats.restart_checksum)


class FilterModule:
    """kube_scheduler_extender filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "scheduler_config_format": scheduler_config_format,
            "scheduler_has_dra": scheduler_has_dra,
            "scheduler_version_from_manifest": scheduler_version_from_manifest,
            "scheduler_wire": scheduler_wire,
            "scheduler_unwire": scheduler_unwire,
            "scheduler_is_wired": scheduler_is_wired,
            "scheduler_config_file_name": scheduler_config_file_name,
            "scheduler_restart_checksum": scheduler_restart_checksum,
        }
