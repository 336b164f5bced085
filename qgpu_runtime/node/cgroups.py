"""From a process's cgroup text to the pod UID and container ID it runs in.

Covers the cgroupfs layout (``/kubepods/burstable/pod<uid>/<id>``) and the systemd one
(``kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope``, also ``docker-``
and ``crio-``), on cgroup v1 and v2.
"""

from __future__ import annotations

import re

_POD = re.compile(r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})")
_CONTAINER = re.compile(r"(?:^|/|-)([0-9a-f]{64})(?:\.scope)?$")


def pod_and_container(cgroup_text: str) -> tuple[str, str] | None:
    """(pod uid, container id) or None when the process is not in a Kubernetes pod."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        pod = _POD.search(path)
        if not pod:
            continue
        container = _CONTAINER.search(path)
        if container:
            return pod.group(1).replace("_", "-"), container.group(1)
    return None


def container_id(status_id: str) -> str:
    """``containerd://<id>`` (or docker://, cri-o://) -> ``<id>``."""
    return status_id.split("://", 1)[-1]
