"""site.yml's install path executed on an EL8-shaped GPU node (tests/elhost/host.py): real dnf
module streams, rpm transactions and scriptlets, systemd units, the version lock and a real reboot.

What this host proves and what only a real TencentOS node with a GPU can: docs/provisioning.md
("The EL8 test host").
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.elhost import host as elhost
from tests.elhost.repo import cached_repos
from tests.provisioning.ansible_tools import Run, ansible_playbook

PIN = "450.102.04"
NEWER = "450.119.04"
OTHER_BRANCH = "470.82.01"
DRIVER_PACKAGES = (
    "nvidia-driver",
    "nvidia-driver-cuda",
    "nvidia-driver-libs",
    "nvidia-driver-NVML",
    "nvidia-driver-devel",
    "nvidia-modprobe",
    "nvidia-persistenced",
    "kmod-nvidia-latest-dkms",
)
OTHER_KERNEL = "4.18.0-240.el8.x86_64"


def _need_host() -> None:
    if os.geteuid() != 0:
        pytest.skip("the EL8 test host needs root (overlay mount, systemd-nspawn)")
    missing = elhost.missing_tools()
    if missing:
        pytest.fail(f"missing {missing}: scripts/local-cluster-deps installs them (apt-get install -y {' '.join(missing)})")


@pytest.fixture(scope="module")
def repos() -> Path:
    _need_host()
    return cached_repos(elhost.CACHE / "repos", kernel=elhost.KERNEL).root


def node_vars(**extra) -> dict:
    """What an operator's inventory says for this node: the repositories' URLs (here the local
    ones) and, because the kernel and GPUs are simulated, where the probes look."""
    base = f"file://{elhost.REPOS_IN_HOST}"
    return {
        "nvidia_driver_repo_base": f"{base}/cuda",
        "cuda_toolkit_repo_base": f"{base}/cuda",
        "nvidia_container_toolkit_repo_url": f"{base}/libnvidia-container/stable/rpm/$basearch",
        "nvidia_container_toolkit_repo_gpgkey": f"{base}/libnvidia-container/gpgkey",
        "nvidia_driver_probe_root": elhost.SIM_ROOT,
        "cuda_toolkit_probe_root": elhost.SIM_ROOT,
        "nvidia_container_toolkit_probe_root": elhost.SIM_ROOT,
        "gpu_preflight_probe_root": elhost.SIM_ROOT,
        "nvidia_driver_kernel_release": elhost.KERNEL,
        "gpu_preflight_kernel_release": elhost.KERNEL,
        # A standalone qgpu host (no cluster here); NVML has no real GPU behind the stand-in driver,
        # so the manager's simulated backend is chosen, explicitly, with the host's two cards.
        "qgpu_manager_gpu_backend": "simulated",
        "qgpu_manager_simulated_gpus": "1xV100-32G,1xT4-16G",
        "qgpu_manager_isolation_policy": "fixed-share",
        **extra,
    }


def site(host: elhost.ElHost, tmp: Path, *extra: str) -> Run:
    inventory = host.inventory(tmp / "hosts.yml", node_vars())
    return ansible_playbook("-i", str(inventory), "playbooks/site.yml", *extra, timeout=900)


def rpm_versions(host: elhost.ElHost, *names: str) -> dict[str, str]:
    out = host.ssh("rpm -q --qf '%{NAME} %{VERSION}\\n' " + " ".join(names), check=False).stdout
    return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)


def loaded(host: elhost.ElHost) -> str:
    return host.ssh(f"cat {elhost.SIM_ROOT}/sys/module/nvidia/version 2>/dev/null || true").stdout.strip()


def locks(host: elhost.ElHost) -> list[str]:
    return sorted(host.ssh("dnf -q versionlock list").stdout.split())


@pytest.fixture(scope="module")
def node(repos: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("el8-node")
    with elhost.ElHost.booted(work / "host", repos) as host:
        yield host, work


def test_site_installs_the_driver_reboots_and_settles(node) -> None:
    host, work = node
    first = site(host, work)
    assert first.returncode == 0, first.output[-6000:]
    assert "nvidia_driver 450.102.04: INSTALLING" in first.output
    # One real reboot: the kmod's DKMS build is loaded only by the next boot.
    assert host.boots() == 2, host.console()
    assert rpm_versions(host, *DRIVER_PACKAGES) == dict.fromkeys(DRIVER_PACKAGES, PIN)
    assert loaded(host) == PIN
    enabled = host.ssh("dnf -q module list --enabled nvidia-driver").stdout
    assert re.search(r"^nvidia-driver\s+450-dkms\s+\[e\]", enabled, re.M), enabled
    assert all(re.search(rf"^{re.escape(name)}-\d+:{re.escape(PIN)}-", "\n".join(locks(host)), re.M) for name in DRIVER_PACKAGES)
    smi = host.ssh("nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader").stdout
    assert smi.splitlines() == ["0, Tesla V100-SXM2-32GB, 450.102.04", "1, Tesla T4, 450.102.04"], smi
    assert host.ssh("systemctl is-enabled nvidia-persistenced; systemctl is-active nvidia-persistenced").stdout.split() == [
        "enabled",
        "active",
    ]
    # nouveau left the initramfs before the reboot, not after it.
    assert "blacklist nouveau" in host.ssh(f"cat /boot/initramfs-{elhost.KERNEL}.img").stdout
    assert rpm_versions(host, "cuda-toolkit-11-3", "nvidia-container-toolkit") == {
        "cuda-toolkit-11-3": "11.3.1",
        "nvidia-container-toolkit": "1.17.8",
    }
    assert "cuda-drivers" not in host.ssh("rpm -qa").stdout
    assert "release 11.3, V11.3.109" in host.ssh("/usr/local/cuda-11.3/bin/nvcc --version").stdout
    # containerd restarted with the toolkit's drop-in and runs the nvidia runtime by default.
    dump = host.ssh("systemctl is-active containerd && containerd config dump").stdout
    assert 'default_runtime_name = "nvidia"' in dump, dump[-3000:]
    assert "/usr/bin/nvidia-container-runtime" in dump
    assert host.ssh("/usr/local/bin/qgpu --version").stdout.startswith("qgpu ")
    # The standalone manager runs on the node, on the simulated cards and with the policy chosen for it.
    status = host.ssh("/usr/local/bin/qgpu status --standalone-db /var/lib/qgpu/meta.db").stdout
    assert re.search(r"^el8-gpu-node\s+fixed-share\s+0\s+V100\s", status, re.M) and re.search(r"\s1\s+T4\s", status), status

    second = site(host, work)
    assert second.returncode == 0, second.output[-6000:]
    assert second.recap_changed() == 0, "\n".join(line for line in second.output.splitlines() if line.startswith("changed:"))
    assert host.boots() == 2


def test_the_version_lock_keeps_dnf_update_off_the_driver(node) -> None:
    host, work = node
    offered = host.ssh("dnf -q list --showduplicates --available nvidia-driver").stdout
    assert NEWER in offered, offered  # the stream carries a newer build ...
    host.ssh("dnf -y -q upgrade")
    assert rpm_versions(host, "nvidia-driver", "kmod-nvidia-latest-dkms") == {  # ... that update leaves alone
        "nvidia-driver": PIN,
        "kmod-nvidia-latest-dkms": PIN,
    }
    # Turned off, the lock is released (left behind it would hold the next pin back); the next
    # test's run, with it on again, locks the new pin.
    off = site(host, work, "-e", "nvidia_driver_versionlock=false")
    assert off.returncode == 0, off.output[-4000:]
    assert not [lock for lock in locks(host) if re.match(r"(nvidia|kmod)-", lock)], locks(host)
    assert host.boots() == 2


def test_the_pin_upgrades_and_downgrades_through_the_roles(node) -> None:
    """Within the stream (450.102.04 -> 450.119.04), to another branch (470-dkms: the stream is
    reset and switched) and back down to the first pin; one reboot each, the lock following."""
    host, work = node
    boots = host.boots()
    for version, stream in ((NEWER, "450-dkms"), (OTHER_BRANCH, "470-dkms"), (PIN, "450-dkms")):
        run = site(host, work, "-e", f"nvidia_driver_version={version}")
        assert run.returncode == 0, run.output[-6000:]
        boots += 1
        assert host.boots() == boots, version
        assert rpm_versions(host, *DRIVER_PACKAGES) == dict.fromkeys(DRIVER_PACKAGES, version)
        assert loaded(host) == version
        assert (
            "nvidia-driver:" + stream
            in host.ssh("cat /etc/dnf/modules.d/nvidia-driver.module | tr -d ' ' | sed -n 's/^stream=/nvidia-driver:/p'").stdout
        )
        held = [lock for lock in locks(host) if re.match(r"(nvidia|kmod)-", lock)]
        assert len(held) == len(DRIVER_PACKAGES) and all(f":{version}-" in lock for lock in held), held
        built = host.ssh("dkms status").stdout
        assert built.count("nvidia/") == 1 and f"nvidia/{version}, {elhost.KERNEL}" in built, built  # old builds left
    again = site(host, work, "-e", f"nvidia_driver_version={PIN}")
    assert again.returncode == 0 and again.recap_changed() == 0, again.output[-4000:]
    assert host.boots() == boots


@pytest.fixture(scope="module")
def fresh_node(repos: Path, tmp_path_factory: pytest.TempPathFactory):
    """A second host, for the inputs the roles must refuse (nothing of the first one's state)."""
    work = tmp_path_factory.mktemp("el8-refusals")
    with elhost.ElHost.booted(work / "host", repos) as host:
        yield host, work


def refused(host: elhost.ElHost, work: Path, *extra: str) -> str:
    """The error the play stopped with (one line per failed task, whitespace folded)."""
    run = site(host, work, *extra)
    assert run.returncode != 0, run.output[-4000:]
    fatal = [line for line in run.output.splitlines() if line.startswith("fatal:")]
    assert fatal, run.output[-4000:]
    message = " ".join(" ".join(fatal).replace("\\n", " ").split())
    print(f"refused as expected: {message}")
    return message


def test_a_driver_from_the_run_installer_is_refused(fresh_node) -> None:
    host, work = fresh_node
    host.ssh(
        "printf '#!/bin/sh\\n' > /usr/bin/nvidia-uninstall && cp /usr/bin/nvidia-uninstall /usr/bin/nvidia-smi"
        " && chmod +x /usr/bin/nvidia-uninstall /usr/bin/nvidia-smi"
    )
    try:
        out = refused(host, work)
        assert "has an NVIDIA driver that no package owns" in out
        assert "/usr/bin/nvidia-uninstall (left by the .run installer)" in out
        assert "not owned by any package" in out  # rpm -qf's own words, passed on
        assert not rpm_versions(host, "nvidia-driver")
    finally:
        host.ssh("rm -f /usr/bin/nvidia-uninstall /usr/bin/nvidia-smi")


def test_a_stream_the_repositories_lack_is_refused(fresh_node) -> None:
    host, work = fresh_node
    out = refused(host, work, "-e", "nvidia_driver_version=440.118.02")
    assert "dnf cannot enable nvidia-driver:440-dkms" in out
    assert "missing groups or modules: nvidia-driver:440-dkms" in out  # dnf's words, passed on
    offered = re.search(r"Streams offered by the enabled repositories: ([^.]*)\.", out)
    assert offered and sorted(offered[1].split(", ")) == ["450-dkms", "470-dkms", "latest-dkms"], out
    assert not rpm_versions(host, "nvidia-driver")


def test_a_pinned_version_the_stream_lacks_is_refused(fresh_node) -> None:
    host, work = fresh_node
    out = refused(host, work, "-e", "nvidia_driver_version=450.999.99")
    assert "dnf could not install nvidia_driver_version=450.999.99 from stream nvidia-driver:450-dkms" in out
    assert "nvidia-driver-450.999.99" in out
    assert not rpm_versions(host, "nvidia-driver")


def test_headers_only_for_another_kernel_are_refused(fresh_node) -> None:
    host, work = fresh_node
    out = refused(
        host,
        work,
        "-e",
        f"nvidia_driver_kernel_release={OTHER_KERNEL}",
        "-e",
        f"gpu_preflight_kernel_release={OTHER_KERNEL}",
    )
    assert f"do not carry the headers of its running kernel {OTHER_KERNEL}" in out
    assert f"kernel-devel offered: {elhost.KERNEL.rsplit('.', 1)[0]}" in out
    assert not rpm_versions(host, "nvidia-driver")
