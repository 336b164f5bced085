"""Local RPM repositories imitating the ones the qgpu Ansible roles install from on EL8.

``build_repos`` makes, with rpmbuild, createrepo_c, modifyrepo_c, gpg and rpmsign:

- ``cuda/rhel8/x86_64``: NVIDIA's CUDA repository: the driver packages (Epoch 3) of five versions in
  the ``nvidia-driver`` module streams 450-dkms / 470-dkms / latest-dkms (default latest-dkms, as
  NVIDIA ships it), CUDA 11.3 toolkit packages, the ``cuda-11-3`` / ``cuda-drivers`` meta-packages
  and the public key ``D42D0685.pub``;
- ``libnvidia-container/stable/rpm/x86_64``: the container toolkit 1.17.7-1 and 1.17.8-1 with a
  signed ``repodata/repomd.xml.asc`` (the role uses repo_gpgcheck=1); the key is
  ``libnvidia-container/gpgkey``;
- ``baseos/x86_64``: TencentOS BaseOS: kernel-devel / kernel-headers of the given kernels, a DKMS
  stand-in and a file-less ``bash`` that provides /bin/sh (rpmbuild always makes a package with a
  scriptlet require /bin/sh, and the test host's rpmdb is otherwise empty).

Every package is ``AutoReqProv: no`` (only the Requires written here exist), x86_64 unless the real
one is noarch, and signed with a key generated for the build (no passphrase); its fingerprint is
``Repos.gpg_fingerprint`` and its public half (armored) is each repository's key file.

The payloads are tiny stand-ins (tests/elhost/standins.py): text markers for libraries and
POSIX sh scripts for nvidia-smi, nvidia-persistenced, dkms, nvcc, nvidia-ctk and friends, which read
the simulated kernel state under /run/qgpu-sim.

``cached_repos`` builds once per (source of this module and standins.py, arguments) and reuses.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.elhost import standins

EPOCH = 3
DRIVER_RELEASE = "1.el8"
# Driver version -> its module stream (NVIDIA's real streams for these branches).
DRIVER_STREAMS: dict[str, str] = {
    "450.80.02": "450-dkms",
    "450.102.04": "450-dkms",
    "450.119.04": "450-dkms",
    "470.82.01": "470-dkms",
    "495.29.05": "latest-dkms",
}
DEFAULT_STREAM = "latest-dkms"
DRIVER_PACKAGES = (
    "nvidia-driver",
    "nvidia-driver-libs",
    "nvidia-driver-NVML",
    "nvidia-driver-cuda",
    "nvidia-driver-devel",
    "nvidia-modprobe",
    "nvidia-persistenced",
    "kmod-nvidia-latest-dkms",
)
CUDA_DRIVERS_VERSION = "465.19.01"  # cuda-drivers of CUDA 11.3.1: wants a driver the repo lacks
CONTAINER_VERSIONS = ("1.17.7-1", "1.17.8-1")
DKMS_VERSION = "3.0.10-1.el8"
BASH_VERSION = "4.4.20-1.el8_4"
VERSIONLOCK_VERSION = "4.0.21-3.el8"

KERNEL_RULE = (
    "an EL kernel release VERSION-RELEASE.ARCH: VERSION digits and dots (4.18.0), one '-', "
    "RELEASE without '-' (305.3.1.el8), ARCH x86_64, e.g. 4.18.0-305.3.1.el8.x86_64"
)
_KERNEL_RE = re.compile(r"(?P<version>\d+(?:\.\d+)*)-(?P<release>[0-9A-Za-z_+~]+(?:\.[0-9A-Za-z_+~]+)*)\.(?P<arch>x86_64)")

Progress = Callable[[str], object]


@dataclass(frozen=True)
class Repos:
    root: Path  # dest
    cuda: Path  # dest/cuda/rhel8/x86_64 (repodata with modules, D42D0685.pub)
    container: Path  # dest/libnvidia-container/stable/rpm/x86_64 (signed repomd.xml.asc); key dest/libnvidia-container/gpgkey
    baseos: Path  # dest/baseos/x86_64; key dest/baseos/RPM-GPG-KEY-qgpu-elhost
    gpg_fingerprint: str

    @property
    def cuda_gpgkey(self) -> Path:
        return self.cuda / "D42D0685.pub"

    @property
    def container_gpgkey(self) -> Path:
        return self.root / "libnvidia-container" / "gpgkey"

    @property
    def baseos_gpgkey(self) -> Path:
        return self.root / "baseos" / "RPM-GPG-KEY-qgpu-elhost"

    def repo_file(self, *, root_url: str | None = None) -> str:
        """A yum.repos.d file with the three repositories configured as the roles configure theirs
        (cuda: gpgcheck; libnvidia-container: repo_gpgcheck, no gpgcheck; baseos: gpgcheck).
        ``root_url`` replaces ``file://<root>`` (e.g. where the test host sees the tree)."""
        base = root_url or self.root.as_uri()
        return textwrap.dedent(f"""\
            [cuda-rhel8-x86_64]
            name=NVIDIA CUDA repository (EL8, x86_64)
            baseurl={base}/cuda/rhel8/x86_64
            gpgkey={base}/cuda/rhel8/x86_64/D42D0685.pub
            gpgcheck=1
            enabled=1

            [nvidia-container-toolkit]
            name=NVIDIA container toolkit
            baseurl={base}/libnvidia-container/stable/rpm/$basearch
            gpgkey={base}/libnvidia-container/gpgkey
            gpgcheck=0
            repo_gpgcheck=1
            enabled=1

            [baseos]
            name=TencentOS Server 3.1 - BaseOS (qgpu stand-in)
            baseurl={base}/baseos/$basearch
            gpgkey={base}/baseos/RPM-GPG-KEY-qgpu-elhost
            gpgcheck=1
            enabled=1
            """)


def parse_kernel(kernel: str) -> tuple[str, str, str]:
    """(version, release, arch) of an EL kernel release; ValueError naming the value and the rule."""
    m = _KERNEL_RE.fullmatch(kernel) if isinstance(kernel, str) else None
    if not m:
        raise ValueError(f"kernel {kernel!r} is not {KERNEL_RULE}")
    return m["version"], m["release"], m["arch"]


# --- packages ----------------------------------------------------------------------------------


@dataclass
class Pkg:
    name: str
    version: str
    release: str
    summary: str
    epoch: int | None = None
    arch: str = "x86_64"  # or "noarch"
    requires: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()
    files: dict[str, tuple[str, int]] = field(default_factory=dict)  # path -> (content, mode)
    symlinks: dict[str, str] = field(default_factory=dict)  # path -> target
    post: str = ""
    preun: str = ""

    @property
    def evr(self) -> str:
        return f"{self.epoch}:{self.version}-{self.release}" if self.epoch is not None else f"{self.version}-{self.release}"

    @property
    def nevra(self) -> str:
        """name-epoch:version-release.arch, as modulemd artifacts spell it (epoch 0 included)."""
        return f"{self.name}-{self.epoch or 0}:{self.version}-{self.release}.{self.arch}"


def _text(content: str) -> tuple[str, int]:
    return content, 0o644


def _exe(content: str) -> tuple[str, int]:
    return content, 0o755


def driver_packages(v: str) -> list[Pkg]:
    """The eight packages the nvidia_driver role pins, for driver version ``v``."""
    evr = f"{EPOCH}:{v}"
    cuda = standins.CUDA_OF_BRANCH.get(v.split(".")[0], "11.0")

    def pkg(name: str, summary: str, **kw) -> Pkg:
        return Pkg(name, v, DRIVER_RELEASE, summary, epoch=EPOCH, **kw)

    return [
        pkg(
            "nvidia-driver",
            "NVIDIA's proprietary display driver for NVIDIA graphic cards",
            requires=(f"nvidia-driver-libs = {evr}", f"nvidia-kmod = {evr}", f"nvidia-modprobe = {evr}"),
            files={f"/usr/lib/nvidia/driver-{v}": _text(f"nvidia-driver {v}\n")},
        ),
        pkg(
            "nvidia-driver-libs",
            "Libraries for nvidia-driver",
            files={f"/usr/lib64/libnvidia-ml.so.{v}": _text(f"libnvidia-ml {v}\n")},
        ),
        pkg(
            "nvidia-driver-NVML",
            "NVIDIA Management Library (NVML)",
            requires=(f"nvidia-driver-libs = {evr}",),
            symlinks={"/usr/lib64/libnvidia-ml.so.1": f"libnvidia-ml.so.{v}"},
        ),
        pkg(
            "nvidia-driver-cuda",
            "CUDA integration for nvidia-driver",
            requires=(f"nvidia-driver = {evr}", f"nvidia-persistenced = {evr}"),
            files={"/usr/bin/nvidia-smi": _exe(standins.render(standins.NVIDIA_SMI, V=v, CUDA=cuda))},
        ),
        pkg(
            "nvidia-driver-devel",
            "Development files for nvidia-driver",
            requires=(f"nvidia-driver = {evr}",),
            files={f"/usr/include/nvidia/driver-{v}.h": _text(f"/* nvidia-driver-devel {v} */\n")},
        ),
        pkg(
            "nvidia-modprobe",
            "Load the NVIDIA kernel driver and create device files",
            files={"/usr/bin/nvidia-modprobe": _exe(standins.render(standins.NVIDIA_MODPROBE, V=v))},
        ),
        pkg(
            "nvidia-persistenced",
            "A daemon to maintain persistent software state in the NVIDIA driver",
            files={
                "/usr/bin/nvidia-persistenced": _exe(standins.render(standins.NVIDIA_PERSISTENCED, V=v)),
                "/usr/lib/systemd/system/nvidia-persistenced.service": _text(
                    textwrap.dedent("""\
                        [Unit]
                        Description=NVIDIA Persistence Daemon
                        Wants=syslog.target

                        [Service]
                        Type=simple
                        ExecStart=/usr/bin/nvidia-persistenced --foreground
                        ExecStopPost=/bin/rm -rf /run/nvidia-persistenced

                        [Install]
                        WantedBy=multi-user.target
                        """)
                ),
            },
        ),
        pkg(
            "kmod-nvidia-latest-dkms",
            "NVIDIA display driver kernel module (DKMS)",
            requires=("dkms",),
            provides=(f"nvidia-kmod = {evr}",),
            files={f"/usr/src/nvidia-{v}/dkms.conf": _text(standins.render(standins.DKMS_CONF, V=v))},
            # NVIDIA's: a failed build (no headers) leaves the package installed, the module unbuilt.
            post=f"dkms add -m nvidia -v {v} --rpm_safe_upgrade || :\ndkms install -m nvidia -v {v} || :\n",
            preun=f"dkms remove -m nvidia -v {v} --all --rpm_safe_upgrade || :\n",
        ),
    ]


def cuda_packages() -> list[Pkg]:
    """CUDA 11.3.1 toolkit packages and the meta-packages that the cuda_toolkit role refuses."""
    version_json = {
        "cuda": {"name": "CUDA SDK", "version": "11.3.1"},
        "cuda_cudart": {"name": "CUDA Runtime (cudart)", "version": "11.3.109"},
        "cuda_nvcc": {"name": "CUDA NVCC", "version": "11.3.109"},
    }
    home = "/usr/local/cuda-11.3"
    return [
        Pkg(
            "cuda-toolkit-11-3",
            "11.3.1",
            "1",
            "CUDA Toolkit 11.3 meta-package",
            requires=("cuda-nvcc-11-3 >= 11.3.109", "cuda-cudart-11-3 >= 11.3.109", "cuda-toolkit-config-common"),
            # Real CUDA 11.x ships version.json in cuda-toolkit-X-Y (with one entry per component).
            files={f"{home}/version.json": _text(json.dumps(version_json, indent=3) + "\n")},
        ),
        Pkg(
            "cuda-nvcc-11-3",
            "11.3.109",
            "1",
            "CUDA nvcc",
            files={f"{home}/bin/nvcc": _exe(standins.render(standins.NVCC, V="11.3.109", MM="11.3"))},
        ),
        Pkg(
            "cuda-cudart-11-3",
            "11.3.109",
            "1",
            "CUDA Runtime native Libraries",
            files={f"{home}/lib64/libcudart.so.11.3.109": _text("libcudart 11.3.109\n")},
            symlinks={f"{home}/lib64/libcudart.so.11.0": "libcudart.so.11.3.109"},
        ),
        Pkg(
            "cuda-toolkit-config-common",
            "11.3.109",
            "1",
            "Common config package for CUDA Toolkit",
            arch="noarch",
            files={"/etc/ld.so.conf.d/000_cuda.conf": _text("/usr/local/cuda/targets/x86_64-linux/lib\n")},
        ),
        Pkg(
            "cuda-11-3",
            "11.3.1",
            "1",
            "CUDA 11.3 meta-package (toolkit and driver)",
            requires=("cuda-toolkit-11-3 >= 11.3.1", f"cuda-drivers >= {CUDA_DRIVERS_VERSION}"),
        ),
        Pkg(
            "cuda-drivers",
            CUDA_DRIVERS_VERSION,
            "1",
            "CUDA driver meta-package (pulls the newest driver)",
            requires=(f"nvidia-driver-cuda = {EPOCH}:{CUDA_DRIVERS_VERSION}", f"nvidia-driver = {EPOCH}:{CUDA_DRIVERS_VERSION}"),
        ),
    ]


def container_packages(vr: str) -> list[Pkg]:
    v, r = vr.split("-")

    def pkg(name: str, summary: str, **kw) -> Pkg:
        return Pkg(name, v, r, summary, **kw)

    return [
        pkg(
            "libnvidia-container1",
            "NVIDIA container runtime library",
            files={f"/usr/lib64/libnvidia-container.so.{v}": _text(f"libnvidia-container {v}\n")},
            symlinks={"/usr/lib64/libnvidia-container.so.1": f"libnvidia-container.so.{v}"},
        ),
        pkg(
            "libnvidia-container-tools",
            "NVIDIA container runtime library (command-line tools)",
            requires=(f"libnvidia-container1 = {vr}",),
            files={"/usr/bin/nvidia-container-cli": _exe(standins.render(standins.NVIDIA_CONTAINER_CLI, V=v))},
        ),
        pkg(
            "nvidia-container-toolkit-base",
            "NVIDIA Container Toolkit Base",
            files={
                "/usr/bin/nvidia-ctk": _exe(standins.render(standins.NVIDIA_CTK, V=v)),
                "/usr/bin/nvidia-container-runtime": _exe(standins.render(standins.NVIDIA_CONTAINER_RUNTIME, V=v)),
            },
        ),
        pkg(
            "nvidia-container-toolkit",
            "NVIDIA Container Toolkit",
            requires=(f"nvidia-container-toolkit-base = {vr}", f"libnvidia-container-tools >= {vr}"),
            files={"/usr/bin/nvidia-container-runtime-hook": _exe(standins.render(standins.NVIDIA_CONTAINER_RUNTIME_HOOK, V=v))},
        ),
    ]


def kernel_packages(kernel: str) -> list[Pkg]:
    v, r, arch = parse_kernel(kernel)
    return [
        Pkg(
            "kernel-devel",
            v,
            r,
            "Development package for building kernel modules to match the kernel",
            arch=arch,
            # Real EL8: kernel-devel is install-only (several side by side) and names its uname -r.
            provides=(f"kernel-devel-uname-r = {kernel}", f"kernel-devel-{arch} = {v}-{r}", "installonlypkg(kernel)"),
            files={f"/usr/src/kernels/{kernel}/Makefile": _text(f"# kernel-devel {kernel} (qgpu stand-in)\n")},
        ),
        Pkg(
            "kernel-headers",
            v,
            r,
            "Header files for the Linux kernel for use by glibc",
            arch=arch,
            provides=(f"kernel-headers-{arch} = {v}-{r}",),
            files={f"/usr/include/linux/version-{kernel}.h": _text(f"/* kernel-headers {kernel} (qgpu stand-in) */\n")},
        ),
    ]


def baseos_packages() -> list[Pkg]:
    """dkms, the file-less bash and the versionlock plugin (kernel_packages gives the kernel's)."""
    dv, dr = DKMS_VERSION.split("-")
    bv, br = BASH_VERSION.split("-")
    lv, lr = VERSIONLOCK_VERSION.split("-")
    return [
        Pkg(
            "dkms",
            dv,
            dr,
            "Dynamic Kernel Module Support Framework (qgpu stand-in)",
            arch="noarch",
            files={"/usr/sbin/dkms": _exe(standins.render(standins.DKMS, V=dv))},
        ),
        Pkg(
            "bash",
            bv,
            br,
            "The GNU Bourne Again shell (file-less: the test host's own shell is used)",
            provides=("/bin/sh", "/bin/bash", "/usr/bin/sh", "/usr/bin/bash"),
        ),
        # The plugin's code comes with the test host's dnf (Debian's dnf-plugins-core); as on EL8,
        # this package's config is what turns it on.
        Pkg(
            "python3-dnf-plugin-versionlock",
            lv,
            lr,
            "Version Lock Plugin for DNF (qgpu stand-in: its configuration)",
            arch="noarch",
            files={
                "/etc/dnf/plugins/versionlock.conf": _text("[main]\nenabled = 1\nlocklist = /etc/dnf/plugins/versionlock.list\n"),
                "/etc/dnf/plugins/versionlock.list": _text(""),
            },
        ),
    ]


# --- building ----------------------------------------------------------------------------------


def _run(cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def _spec(group: str, pkgs: list[Pkg], stage: Path) -> str:
    out = [
        f"Name: qgpu-elhost-{group}",
        "Version: 0",
        "Release: 0",
        "Summary: qgpu test repository group (never built itself)",
        "License: MIT",
        "AutoReqProv: no",
        "",
        "%description",
        "Spec of several qgpu stand-in packages.",
        "",
    ]
    for p in pkgs:
        out += [f"%package -n {p.name}", f"Version: {p.version}", f"Release: {p.release}", f"Summary: {p.summary}", "AutoReqProv: no"]
        if p.epoch is not None:
            out.append(f"Epoch: {p.epoch}")
        if p.arch == "noarch":
            out.append("BuildArch: noarch")
        out += [f"Requires: {r}" for r in p.requires]
        out += [f"Provides: {r}" for r in p.provides]
        out += ["", f"%description -n {p.name}", f"{p.summary}. qgpu test stand-in (tests/elhost/repo.py).", ""]
    out += ["%install", f"cp -a {stage}/. %{{buildroot}}/", ""]
    for p in pkgs:
        out += [f"%files -n {p.name}", "%defattr(-,root,root,-)"]
        out += sorted([*p.files, *p.symlinks])
        out.append("")
        if p.post:
            out += [f"%post -n {p.name}", p.post.rstrip(), ""]
        if p.preun:
            out += [f"%preun -n {p.name}", p.preun.rstrip(), ""]
    return "\n".join(out) + "\n"


def _rpmbuild(group: str, pkgs: list[Pkg], work: Path, outdir: Path) -> list[Path]:
    """Build one spec holding ``pkgs`` as subpackages; move the RPMs to ``outdir``."""
    top = work / "rpmbuild" / group
    stage = work / "stage" / group
    for p in pkgs:
        for path, (content, mode) in p.files.items():
            f = stage / path.lstrip("/")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(content)
            f.chmod(mode)
        for path, target in p.symlinks.items():
            f = stage / path.lstrip("/")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.symlink_to(target)
    stage.mkdir(parents=True, exist_ok=True)
    (top / "SPECS").mkdir(parents=True)
    spec = top / "SPECS" / f"{group}.spec"
    spec.write_text(_spec(group, pkgs, stage))
    defines = {
        "_topdir": str(top),
        "_tmppath": str(top / "tmp"),
        "__os_install_post": "%{nil}",
        "debug_package": "%{nil}",
        "_build_id_links": "none",
        "_binary_payload": "w6.xzdio",  # EL8's rpm 4.14 reads xz, not every build of it zstd
        "_binary_filedigest_algorithm": "8",
        "_buildhost": "qgpu-elhost",
        "_source_date_epoch_from_changelog": "0",
        "use_source_date_epoch_as_buildtime": "1",
    }
    cmd = ["rpmbuild", "-bb", "--nodeps", "--quiet", "--target", "x86_64"]
    for k, v in defines.items():
        cmd += ["--define", f"{k} {v}"]
    env = dict(os.environ, SOURCE_DATE_EPOCH="1622505600", LC_ALL="C")
    (top / "tmp").mkdir()
    _run([*cmd, str(spec)], env=env)
    built = sorted((top / "RPMS").rglob("*.rpm"))
    expected = {f"{p.name}-{p.version}-{p.release}.{p.arch}.rpm" for p in pkgs}
    if {b.name for b in built} != expected:
        raise RuntimeError(f"rpmbuild of {group} made {[b.name for b in built]}, expected {sorted(expected)}")
    outdir.mkdir(parents=True, exist_ok=True)
    moved = []
    for b in built:
        shutil.move(str(b), outdir / b.name)
        moved.append(outdir / b.name)
    return moved


class _Gpg:
    """A throw-away GnuPG home with one RSA 2048 signing key without passphrase."""

    def __init__(self) -> None:
        # A short path: gpg-agent's socket lives here and sun_path holds 108 bytes.
        self.home = Path(tempfile.mkdtemp(prefix="qgpu-gpg-"))
        self.home.chmod(0o700)
        self.env = dict(os.environ, GNUPGHOME=str(self.home), LC_ALL="C")
        self.fingerprint = ""

    def generate(self) -> str:
        self.gpg(
            "--quick-gen-key",
            "--passphrase",
            "",
            "--pinentry-mode",
            "loopback",
            "qgpu elhost test repositories <elhost@qgpu.invalid>",
            "rsa2048",
            "sign",
            "never",
        )
        for line in self.gpg("--with-colons", "--list-secret-keys").splitlines():
            if line.startswith("fpr:"):
                self.fingerprint = line.split(":")[9]
                break
        if not self.fingerprint:
            raise RuntimeError("gpg generated no key")
        return self.fingerprint

    def gpg(self, *args: str) -> str:
        return _run(["gpg", "--batch", "--no-tty", "--homedir", str(self.home), *args], env=self.env)

    def export(self) -> str:
        return self.gpg("--armor", "--export", self.fingerprint)

    def sign_rpms(self, rpms: list[Path]) -> None:
        # Debian's rpm has %__gpg /usr/bin/gpg2, which Debian's gnupg does not install.
        defines = {"__gpg": shutil.which("gpg") or "gpg", "_gpg_name": self.fingerprint, "_gpg_path": str(self.home)}
        _run(["rpmsign", "--addsign", *(a for k, v in defines.items() for a in ("--define", f"{k} {v}")), *map(str, rpms)], env=self.env)

    def detach_sign(self, path: Path) -> None:
        self.gpg("--yes", "--armor", "--local-user", self.fingerprint, "--detach-sign", "--output", f"{path}.asc", str(path))

    def close(self) -> None:
        subprocess.run(["gpgconf", "--homedir", str(self.home), "--kill", "all"], capture_output=True, env=self.env)
        shutil.rmtree(self.home, ignore_errors=True)


def modules_yaml(drivers: dict[str, list[Pkg]]) -> str:
    """modulemd v2 documents of nvidia-driver's streams, and the defaults (stream latest-dkms)."""
    docs = []
    streams: dict[str, list[Pkg]] = {}
    for v, pkgs in drivers.items():
        streams.setdefault(DRIVER_STREAMS[v], []).extend(pkgs)
    profile = ["nvidia-driver", "nvidia-driver-cuda", "nvidia-driver-libs", "nvidia-driver-NVML", "kmod-nvidia-latest-dkms"]
    for i, (stream, pkgs) in enumerate(sorted(streams.items())):
        artifacts = "\n".join(f"      - {p.nevra}" for p in sorted(pkgs, key=lambda p: (p.name, p.version)))
        api = "\n".join(f"      - {n}" for n in DRIVER_PACKAGES)
        prof = "\n".join(f"          - {n}" for n in profile)
        docs.append(
            f"""---
document: modulemd
version: 2
data:
  name: nvidia-driver
  stream: "{stream}"
  version: {20210601000000 + i}
  context: "{hashlib.sha1(stream.encode()).hexdigest()[:8]}"
  arch: x86_64
  summary: Nvidia driver for {stream} branch
  description: >-
    This module provides the NVIDIA driver packages of the {stream} branch (qgpu stand-in).
  license:
    module:
      - MIT
  profiles:
    default:
      description: Default installation
      rpms:
{prof}
    fm:
      description: FabricManager installation
      rpms:
{prof}
    src:
      description: Source files for compiling open kernel modules
      rpms:
          - nvidia-driver-devel
  api:
    rpms:
{api}
  artifacts:
    rpms:
{artifacts}
...
"""
        )
    docs.append(
        f"""---
document: modulemd-defaults
version: 1
data:
  module: nvidia-driver
  stream: {DEFAULT_STREAM}
  profiles:
    {DEFAULT_STREAM}: [default]
...
"""
    )
    return "".join(docs)


def _createrepo(repo: Path) -> None:
    _run(["createrepo_c", "--quiet", "--no-database", "--simple-md-filenames", str(repo)])


def build_repos(dest: Path, *, kernel: str, other_kernel: str | None = None, progress: Progress = print) -> Repos:
    """Build the three repositories under ``dest`` (created; must not hold them already).

    ``kernel`` (and ``other_kernel`` if given) is an EL kernel release, e.g.
    ``4.18.0-305.3.1.el8.x86_64``; BaseOS carries kernel-devel and kernel-headers of each.
    """
    kernels = [parse_kernel(k) and k for k in (kernel, other_kernel) if k is not None]
    for tool in ("rpmbuild", "rpmsign", "createrepo_c", "modifyrepo_c", "gpg", "gpgconf"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found: apt-get install rpm createrepo-c gnupg")
    dest = Path(dest)
    repos = Repos(
        root=dest,
        cuda=dest / "cuda" / "rhel8" / "x86_64",
        container=dest / "libnvidia-container" / "stable" / "rpm" / "x86_64",
        baseos=dest / "baseos" / "x86_64",
        gpg_fingerprint="",
    )
    work = Path(tempfile.mkdtemp(prefix="qgpu-elrepo-"))
    gpg = _Gpg()
    try:
        progress(f"elhost repos: generating the signing key in {gpg.home}")
        fpr = gpg.generate()
        key = gpg.export()
        rpms: list[Path] = []
        drivers = {v: driver_packages(v) for v in DRIVER_STREAMS}
        for v, pkgs in drivers.items():
            progress(f"elhost repos: building nvidia-driver {v} ({len(pkgs)} packages)")
            rpms += _rpmbuild(f"driver-{v}", pkgs, work, repos.cuda)
        progress("elhost repos: building CUDA 11.3, libnvidia-container and BaseOS packages")
        rpms += _rpmbuild("cuda", cuda_packages(), work, repos.cuda)
        for vr in CONTAINER_VERSIONS:
            rpms += _rpmbuild(f"container-{vr}", container_packages(vr), work, repos.container)
        rpms += _rpmbuild("baseos", baseos_packages(), work, repos.baseos)
        for k in kernels:  # one spec per kernel: a spec holds each package name once
            rpms += _rpmbuild(f"kernel-{k}", kernel_packages(k), work, repos.baseos)
        progress(f"elhost repos: signing {len(rpms)} packages with {fpr}")
        gpg.sign_rpms(rpms)

        progress("elhost repos: writing the repository metadata")
        for repo in (repos.cuda, repos.container, repos.baseos):
            _createrepo(repo)
        modules = work / "modules.yaml"
        modules.write_text(modules_yaml(drivers))
        _run(["modifyrepo_c", "--mdtype=modules", "--simple-md-filenames", str(modules), str(repos.cuda / "repodata")])
        shutil.copy(modules, repos.cuda / "modules.yaml")
        gpg.detach_sign(repos.container / "repodata" / "repomd.xml")

        repos.cuda_gpgkey.write_text(key)
        repos.container_gpgkey.write_text(key)
        repos.baseos_gpgkey.write_text(key)
        repos = Repos(repos.root, repos.cuda, repos.container, repos.baseos, fpr)
        (dest / "repos.json").write_text(
            json.dumps({"gpg_fingerprint": fpr, "kernel": kernel, "other_kernel": other_kernel, "packages": sorted(r.name for r in rpms)}, indent=1)
            + "\n"
        )
        return repos
    finally:
        gpg.close()
        shutil.rmtree(work, ignore_errors=True)


def _source_hash(*args: object) -> str:
    h = hashlib.sha256()
    for module in (Path(__file__), Path(standins.__file__)):
        h.update(module.read_bytes())
    h.update(repr(args).encode())
    return h.hexdigest()[:16]


def _load(root: Path) -> Repos:
    meta = json.loads((root / "repos.json").read_text())
    return Repos(
        root=root,
        cuda=root / "cuda" / "rhel8" / "x86_64",
        container=root / "libnvidia-container" / "stable" / "rpm" / "x86_64",
        baseos=root / "baseos" / "x86_64",
        gpg_fingerprint=meta["gpg_fingerprint"],
    )


def cached_repos(cache_dir: Path, *, kernel: str, other_kernel: str | None = None, progress: Progress = print) -> Repos:
    """``build_repos`` into ``cache_dir/<hash of this source and the arguments>/``, once.

    Built in a temporary sibling directory and renamed into place, so a concurrent or interrupted
    build never leaves a half-built tree under the final name. ``progress`` gets a line before any
    long work (nothing when the cache is reused)."""
    for k in (kernel, other_kernel):
        if k is not None:
            parse_kernel(k)
    cache_dir = Path(cache_dir)
    final = cache_dir / _source_hash(kernel, other_kernel)
    if (final / "repos.json").is_file():
        return _load(final)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache_dir))
    try:
        progress(f"elhost repos: building into {final} (once; later runs reuse it)")
        build_repos(tmp, kernel=kernel, other_kernel=other_kernel, progress=progress)
        tmp.chmod(0o755)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "repos.json").is_file():  # another builder won the race: use its tree
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _load(final)
