"""The repositories of tests/elhost/repo.py behave like NVIDIA's and TencentOS's for EL8 dnf.

Everything runs ``dnf --installroot`` on this machine (no container): module streams and their
filtering, pinned installs with signature checks, upgrades and downgrades, repo_gpgcheck.

Scriptlets (the DKMS build of kmod-nvidia-latest-dkms) run chrooted into the installroot, which has
no shell of its own: with ``busybox`` on this machine (apt-get install busybox-static) the
installroot gets it as /bin/sh and the tests check the scriptlets' effects; without it they install
with ``tsflags=noscripts`` and check the DKMS stand-in by running the installed script directly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.elhost.repo import DRIVER_PACKAGES, KERNEL_RULE, Repos, build_repos, cached_repos, parse_kernel

pytestmark = pytest.mark.slow  # builds 60 RPMs and runs dnf a few dozen times (~30 s)

KERNEL = "4.18.0-305.3.1.el8.x86_64"
OTHER_KERNEL = "4.18.0-348.7.1.el8_5.x86_64"
TOOLS = ("rpmbuild", "rpmsign", "createrepo_c", "modifyrepo_c", "gpg", "dnf", "rpm")
BUSYBOX = shutil.which("busybox")


@pytest.fixture(scope="module")
def progress_lines() -> list[str]:
    return []


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("elrepo-cache")


@pytest.fixture(scope="module")
def repos(cache_dir: Path, progress_lines: list[str]) -> Repos:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing: apt-get install rpm createrepo-c dnf python3-dnf gnupg")
    return cached_repos(cache_dir, kernel=KERNEL, other_kernel=OTHER_KERNEL, progress=progress_lines.append)


class Root:
    """An installroot with the three repositories configured as the roles configure them."""

    def __init__(self, path: Path, repo_text: str) -> None:
        self.path = path
        (path / "etc" / "yum.repos.d").mkdir(parents=True)
        (path / "etc" / "yum.repos.d" / "qgpu.repo").write_text(repo_text)
        self.scripts = BUSYBOX is not None
        if BUSYBOX:
            # The scriptlets run chrooted here: give them a (static) shell and the usual tools.
            (path / "bin").mkdir()
            shutil.copy(BUSYBOX, path / "bin" / "busybox")
            applets = subprocess.run([BUSYBOX, "--list-full"], capture_output=True, text=True, check=True).stdout.split()
            for applet in applets:
                link = path / applet
                if not link.exists():
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.symlink_to("/bin/busybox")

    def dnf(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = str(self.path)
        cmd = [
            "dnf",
            f"--installroot={r}",
            f"--setopt=reposdir={r}/etc/yum.repos.d",
            f"--setopt=cachedir={r}/var/cache/dnf",
            "--setopt=module_platform_id=platform:el8",
            "--setopt=install_weak_deps=False",
            # EL8's dnf.conf, not Debian's (skip_if_unavailable=True, best=False).
            "--setopt=skip_if_unavailable=False",
            "--setopt=best=True",
            "--releasever=8",
            "--forcearch=x86_64",
            "--noplugins",
            "-y",
        ]
        if not self.scripts:
            cmd.append("--setopt=tsflags=noscripts")
        proc = subprocess.run([*cmd, *args], capture_output=True, text=True, env=dict(os.environ, LC_ALL="C.UTF-8"), timeout=120)
        out = proc.stdout + proc.stderr
        if check and proc.returncode != 0:
            raise AssertionError(f"dnf {' '.join(args)} failed (rc={proc.returncode}):\n{out}")
        return proc

    def close(self) -> None:
        """Stop the gpg-agent that librepo starts (and leaves running) for each repo_gpgcheck keyring."""
        for pubring in self.path.glob("var/cache/dnf/*/pubring"):
            subprocess.run(["gpgconf", "--homedir", str(pubring), "--kill", "gpg-agent"], capture_output=True)

    def rpm(self, *args: str) -> str:
        proc = subprocess.run(["rpm", f"--root={self.path}", *args], capture_output=True, text=True)
        return proc.stdout + proc.stderr

    def installed(self) -> set[str]:
        return set(self.rpm("-qa", "--qf", "%{NAME}-%{EPOCHNUM}:%{VERSION}-%{RELEASE}\n").split())

    def dkms(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The installed DKMS stand-in, run against this root without chroot."""
        env = dict(os.environ, QGPU_ELHOST_ROOT=str(self.path))
        return subprocess.run(["sh", str(self.path / "usr/sbin/dkms"), *args], capture_output=True, text=True, env=env)


@pytest.fixture
def root(tmp_path: Path, repos: Repos) -> Iterator[Root]:
    r = Root(tmp_path / "root", repos.repo_file())
    yield r
    r.close()


def pinned(version: str) -> list[str]:
    return [f"{name}-{version}" for name in DRIVER_PACKAGES]


def driver_set(version: str) -> set[str]:
    return {f"{name}-3:{version}-1.el8" for name in DRIVER_PACKAGES}


def available(root: Root, name: str) -> list[str]:
    out = root.dnf("-q", "list", "--available", "--showduplicates", name).stdout
    return [line.split()[1] for line in out.splitlines() if line.startswith(f"{name}.")]


def test_module_streams_filter_the_driver_versions(root: Root) -> None:
    listing = root.dnf("module", "list", "nvidia-driver").stdout
    assert "latest-dkms [d]" in listing
    assert "450-dkms " in listing and "470-dkms " in listing
    # The default stream hides the other streams' packages, as on EL8.
    assert available(root, "nvidia-driver") == ["3:495.29.05-1.el8"]
    assert available(root, "kmod-nvidia-latest-dkms") == ["3:495.29.05-1.el8"]

    root.dnf("module", "enable", "nvidia-driver:450-dkms")
    assert "stream=450-dkms" in (root.path / "etc/dnf/modules.d/nvidia-driver.module").read_text()
    assert available(root, "nvidia-driver") == ["3:450.80.02-1.el8", "3:450.102.04-1.el8", "3:450.119.04-1.el8"]
    # Not modular: unfiltered.
    assert sorted(available(root, "kernel-devel")) == ["4.18.0-305.3.1.el8", "4.18.0-348.7.1.el8_5"]

    missing = root.dnf("module", "enable", "nvidia-driver:440-dkms", check=False)
    assert missing.returncode == 1
    assert "missing groups or modules: nvidia-driver:440-dkms" in missing.stdout + missing.stderr

    # Switching branches is reset + enable, like the role's plan.
    root.dnf("module", "reset", "nvidia-driver")
    root.dnf("module", "enable", "nvidia-driver:470-dkms")
    assert available(root, "nvidia-driver") == ["3:470.82.01-1.el8"]


def test_pinned_install_upgrade_and_downgrade(root: Root, repos: Repos) -> None:
    root.dnf("module", "enable", "nvidia-driver:450-dkms")
    result = root.dnf("install", f"kernel-devel-{KERNEL}", f"kernel-headers-{KERNEL}")
    out = result.stdout + result.stderr  # dnf 4.14 prints the key import on stderr
    # gpgcheck=1 with gpgkey=file://: dnf imports the key into the root's rpmdb and checks each RPM.
    assert "Importing GPG key" in out and repos.gpg_fingerprint[-16:] in out.replace(" ", "")
    assert f"gpg-pubkey-0:{repos.gpg_fingerprint[-8:].lower()}" in " ".join(root.installed())
    root.dnf("install", *pinned("450.102.04"))
    assert driver_set("450.102.04") | {"dkms-0:3.0.10-1.el8", "bash-0:4.4.20-1.el8_4"} <= root.installed()
    assert not any(p.startswith(("cuda-drivers", "cuda-11-3")) for p in root.installed())

    signed = root.rpm("-K", str(repos.cuda / "kmod-nvidia-latest-dkms-450.102.04-1.el8.x86_64.rpm"))
    assert "digests signatures OK" in signed, signed
    assert (root.path / "usr/src/nvidia-450.102.04/dkms.conf").is_file()
    modules = root.path / "lib/modules" / KERNEL / "extra"
    if not root.scripts:
        assert root.dkms("add", "-m", "nvidia", "-v", "450.102.04").returncode == 0
        assert root.dkms("install", "-m", "nvidia", "-v", "450.102.04").returncode == 0
    assert (modules / "nvidia.ko.xz").read_text() == "nvidia 450.102.04\n"
    assert root.dkms("status").stdout == f"nvidia/450.102.04, {KERNEL}, x86_64: installed\n"

    # Upgrade: the new %post builds 450.119.04 before the old %preun removes only 450.102.04's.
    root.dnf("install", *pinned("450.119.04"))
    assert driver_set("450.119.04") <= root.installed() and not driver_set("450.102.04") & root.installed()
    if not root.scripts:
        root.dkms("add", "-m", "nvidia", "-v", "450.119.04")
        root.dkms("install", "-m", "nvidia", "-v", "450.119.04")
        root.dkms("remove", "-m", "nvidia", "-v", "450.102.04", "--all")
    assert (modules / "nvidia-uvm.ko.xz").read_text() == "nvidia 450.119.04\n"
    assert root.dkms("status").stdout == f"nvidia/450.119.04, {KERNEL}, x86_64: installed\n"

    # Downgrade back to the pin, as the role's dnf(allow_downgrade) does.
    root.dnf("install", "--allowerasing", *pinned("450.102.04"))
    assert driver_set("450.102.04") <= root.installed() and not driver_set("450.119.04") & root.installed()
    if root.scripts:
        assert (modules / "nvidia.ko.xz").read_text() == "nvidia 450.102.04\n"

    # CUDA toolkit: version.json as gpu_preflight reads it; the meta-packages cannot pull a driver.
    root.dnf("install", "cuda-toolkit-11-3")
    version = json.loads((root.path / "usr/local/cuda-11.3/version.json").read_text())
    assert version["cuda"]["version"] == "11.3.1"
    meta = root.dnf("install", "cuda-11-3", check=False)
    assert meta.returncode == 1 and "nvidia-driver-cuda = 3:465.19.01" in meta.stdout + meta.stderr


def test_no_kernel_headers_leaves_the_module_unbuilt(root: Root) -> None:
    root.dnf("module", "enable", "nvidia-driver:450-dkms")
    result = root.dnf("install", "kmod-nvidia-latest-dkms-450.102.04")  # the transaction still succeeds
    if root.scripts:
        assert "Error! Your kernel headers for kernel" in result.stdout + result.stderr
    else:
        root.dkms("add", "-m", "nvidia", "-v", "450.102.04")
        failed = root.dkms("install", "-m", "nvidia", "-v", "450.102.04")
        assert failed.returncode == 1 and "Error! Your kernel headers for kernel" in failed.stderr
    assert "kmod-nvidia-latest-dkms-3:450.102.04-1.el8" in root.installed()
    assert not (root.path / "lib/modules").exists()
    assert root.dkms("status").stdout == "nvidia/450.102.04: added\n"

    # Headers of another kernel than the running one: DKMS builds for the kernels it has headers of.
    root.dnf("install", f"kernel-devel-{OTHER_KERNEL}")
    assert root.dkms("install", "-m", "nvidia", "-v", "450.102.04").returncode == 0
    assert (root.path / "lib/modules" / OTHER_KERNEL / "extra/nvidia.ko.xz").read_text() == "nvidia 450.102.04\n"
    assert not (root.path / "lib/modules" / KERNEL).exists()


def test_container_repo_checks_the_repomd_signature(root: Root, repos: Repos, tmp_path: Path) -> None:
    assert (repos.container / "repodata/repomd.xml.asc").is_file()
    root.dnf("install", "nvidia-container-toolkit-1.17.8-1")
    assert {
        "nvidia-container-toolkit-0:1.17.8-1",
        "nvidia-container-toolkit-base-0:1.17.8-1",
        "libnvidia-container-tools-0:1.17.8-1",
        "libnvidia-container1-0:1.17.8-1",
    } <= root.installed()
    ctk = subprocess.run(["sh", str(root.path / "usr/bin/nvidia-ctk"), "--version"], capture_output=True, text=True)
    assert ctk.stdout.startswith("NVIDIA Container Toolkit CLI version 1.17.8\n")
    root.dnf("install", "nvidia-container-toolkit-1.17.7-1", "nvidia-container-toolkit-base-1.17.7-1")  # downgrade
    assert "nvidia-container-toolkit-0:1.17.7-1" in root.installed()

    # A repomd.xml that is not the signed one is refused.
    tampered = tmp_path / "tampered"
    shutil.copytree(repos.container, tampered / "x86_64")
    repomd = tampered / "x86_64/repodata/repomd.xml"
    repomd.write_text(repomd.read_text().replace("</repomd>", "<!-- tampered --></repomd>"))
    text = repos.repo_file().replace(f"{repos.root.as_uri()}/libnvidia-container/stable/rpm/", f"{tampered.as_uri()}/")
    bad_root = Root(tmp_path / "bad", text)
    try:
        bad = bad_root.dnf("makecache", "--repo", "nvidia-container-toolkit", check=False)
    finally:
        bad_root.close()
    assert bad.returncode == 1
    assert "repomd.xml GPG signature verification error" in bad.stdout + bad.stderr


@pytest.mark.parametrize("kernel", ["5.4.119-19-0009.11", "4.18.0-305.3.1.el8", "4.18.0.x86_64", "linux", ""])
def test_kernel_that_is_not_el_shaped_is_refused(kernel: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        build_repos(tmp_path, kernel=kernel)
    assert repr(kernel) in str(err.value) and KERNEL_RULE in str(err.value)
    assert parse_kernel(KERNEL) == ("4.18.0", "305.3.1.el8", "x86_64")


def test_cached_repos_reuses_the_build(repos: Repos, cache_dir: Path, progress_lines: list[str]) -> None:
    assert progress_lines, "the first build reports progress"
    stamp = (repos.root / "repos.json").stat().st_mtime_ns
    again: list[str] = []
    assert cached_repos(cache_dir, kernel=KERNEL, other_kernel=OTHER_KERNEL, progress=again.append) == repos
    assert again == [] and (repos.root / "repos.json").stat().st_mtime_ns == stamp
    assert [p.name for p in cache_dir.iterdir()] == [repos.root.name]  # no temporary left behind
