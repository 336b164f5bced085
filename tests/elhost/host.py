"""A test host shaped like the reference GPU node: TencentOS Server 3.1 (EL8) with systemd and dnf.

No EL8 image can be had here, so the host is built from what can: a Debian userland made by
debootstrap (cached under .cache/elhost), carrying Debian's dnf 4.14, rpm and systemd, dressed to
report itself as TencentOS Server 3.1 (/etc/os-release, /etc/tencentos-release; Ansible's facts
say distribution TencentOS, major version 3) and booted with systemd as PID 1 by systemd-nspawn.
dnf reads the local repositories of tests/elhost/repo.py, bind-mounted read-only at
/srv/qgpu-repos; its rpm database starts empty, so every package the roles install is resolved
and installed by dnf and rpm for real, scriptlets included. Ansible reaches the host over ssh on
127.0.0.1, like a real node.

What only the machine's kernel could give is simulated, and only that: the GPUs on the PCI bus,
the loaded nvidia module and its device nodes. A boot-time unit (qgpu-sim-kernel.service, part of
the host, not of any package) writes them under /run/qgpu-sim: PCI devices from the host's GPU
list, and the nvidia module "loaded" only when DKMS installed one for the host's kernel before
this boot, so a new driver takes effect after a reboot and not before. /run/qgpu-sim links to
/usr, /etc, /lib and /var of the host, so the roles' probe root sees the installed software as is.
The host's kernel identity (kernel-devel, DKMS, /lib/modules) is an EL-shaped release
(KERNEL) because rpm cannot name this machine's kernel; `uname -r` still shows the real one.

A reboot is real: `shutdown -r` ends the nspawn machine with exit status 133 and the supervisor
boots it again from the same root (systemd-nspawn gives every boot a new boot_id, which is what
ansible.builtin.reboot waits for).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.k8s.controlplane import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE = REPO_ROOT / ".cache" / "elhost"
SUITE = "bookworm"
MIRROR = os.environ.get("QGPU_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# The EL8 kernel the host presents to rpm, DKMS and the roles (TencentOS 3.1 ships RHCK 4.18).
KERNEL = "4.18.0-305.3.1.el8.x86_64"
# Debian packages of the base: init, ssh for Ansible, dnf + rpm (+ the versionlock plugin's code),
# Python for Ansible's modules and the runtime's virtualenv, containerd for the toolkit's drop-in.
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "python3-venv",
    "python3-dnf",
    "dnf",
    "dnf-plugins-core",
    "rpm",
    "kmod",
    "iproute2",
    "procps",
    "containerd",
    "runc",
)
TOOLS = {
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
}
# GPUs of the simulated PCI bus: index, name, memory MiB, PCI bus id, UUID, PCI device id.
DEFAULT_GPUS = (
    (0, "Tesla V100-SXM2-32GB", 32510, "0000:3b:00.0", "GPU-5b1a7c1e-0000-4000-8000-00000000a100", "0x1db5"),
    (1, "Tesla T4", 15109, "0000:86:00.0", "GPU-5b1a7c1e-0000-4000-8000-00000000a101", "0x1eb8"),
)
REPOS_IN_HOST = "/srv/qgpu-repos"
SIM_ROOT = "/run/qgpu-sim"
EXIT_REBOOT = 133


class HostError(RuntimeError):
    """The test host could not be built, booted or reached; the message says what and why."""


def missing_tools() -> list[str]:
    """Debian packages to install before a host can be built (empty when all are there)."""
    return sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})


def _run(cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise HostError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def base_rootfs(progress=print) -> Path:
    """The debootstrapped Debian base, built once per package set and reused."""
    key = hashlib.sha256("\n".join((SUITE, MIRROR, *PACKAGES)).encode()).hexdigest()[:16]
    base = CACHE / f"base-{key}"
    if (base / "etc" / "os-release").exists():
        return base
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = CACHE / f"base-{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    progress(f"elhost: debootstrap {SUITE} with {len(PACKAGES)} packages into {base} (once, about a minute)")
    _run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            SUITE,
            str(tmp),
            MIRROR,
        ]
    )
    # Debian's apt and dpkg stay (they own the base), but nothing in the host may use them.
    tmp.rename(base)
    return base


OS_RELEASE = """NAME="TencentOS Server"
VERSION="3.1 (Final)"
ID="tencentos"
ID_LIKE="rhel fedora centos"
VERSION_ID="3.1"
PLATFORM_ID="platform:el8"
PRETTY_NAME="TencentOS Server 3.1 (Final)"
ANSI_COLOR="0;31"
CPE_NAME="cpe:/o:tencent:tencentos:3"
HOME_URL="https://github.com/Tencent/TencentOS-kernel"
"""

SIM_KERNEL = f"""#!/bin/sh
# qgpu test host: what the kernel would show. PCI devices of the GPUs always; the nvidia module
# (and its device nodes) only when DKMS installed one for this kernel before this boot and the
# initramfs keeps nouveau off the GPUs.
set -eu
K=$(cat /etc/qgpu-sim/kernel)
R={SIM_ROOT}
rm -rf "$R"
mkdir -p "$R/sys/bus/pci/devices" "$R/sys/module" "$R/dev"
for d in usr etc lib lib64 var opt bin sbin; do ln -s "/$d" "$R/$d"; done
: > "$R/gpus"
while IFS=, read -r idx name mem bus uuid dev; do
  [ -n "$idx" ] || continue
  p="$R/sys/bus/pci/devices/$bus"
  mkdir -p "$p"
  echo 0x10de > "$p/vendor"
  echo 0x030200 > "$p/class"
  echo "$dev" > "$p/device"
  echo "$idx,$name,$mem,$bus,$uuid" >> "$R/gpus"
done < /etc/qgpu-sim/gpus
ko="/lib/modules/$K/extra/nvidia.ko.xz"
# nouveau binds the GPUs first unless the initramfs this boot started from holds it off.
if [ -f "$ko" ] && grep -qs '^blacklist nouveau' "/boot/initramfs-$K.img"; then
  version=$(sed -n 's/^nvidia //p' "$ko")
  mkdir -p "$R/sys/module/nvidia"
  echo "$version" > "$R/sys/module/nvidia/version"
  : > "$R/dev/nvidiactl"
  n=0
  while [ "$n" -lt "$(grep -c . "$R/gpus")" ]; do : > "$R/dev/nvidia$n"; n=$((n + 1)); done
  if [ -f "/lib/modules/$K/extra/nvidia-uvm.ko.xz" ]; then : > "$R/dev/nvidia-uvm"; fi
fi
"""

SIM_KERNEL_UNIT = """[Unit]
Description=qgpu test host: the simulated kernel's GPUs and nvidia module
DefaultDependencies=no
After=local-fs.target
Before=sysinit.target nvidia-persistenced.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/libexec/qgpu-sim-kernel

[Install]
WantedBy=sysinit.target
"""

# EL8's dracut rebuilds the initramfs of the running kernel; the host has no initramfs to boot, so
# this stand-in records the rebuild where a test can see it.
DRACUT = """#!/bin/sh
set -eu
K=$(cat /etc/qgpu-sim/kernel)
mkdir -p /boot
{ echo "initramfs for $K"; cat /etc/modprobe.d/*.conf 2>/dev/null; } > "/boot/initramfs-$K.img"
echo "dracut: rebuilt /boot/initramfs-$K.img"
"""


@dataclass
class ElHost:
    """One booted test host. Use `with ElHost.booted(workdir, repos) as host:`."""

    workdir: Path
    repos: Path
    kernel: str = KERNEL
    gpus: Sequence[tuple] = DEFAULT_GPUS
    port: int = field(default_factory=free_port)
    progress: Callable[[str], object] = print
    _supervisor: subprocess.Popen | None = None

    @property
    def root(self) -> Path:
        return self.workdir / "root"

    @property
    def key(self) -> Path:
        return self.workdir / "id_ed25519"

    @property
    def boots_file(self) -> Path:
        return self.workdir / "boots"

    # --- building -----------------------------------------------------------------------------
    def prepare(self) -> None:
        missing = missing_tools()
        if missing:
            raise HostError(f"missing tools: apt-get install -y --no-install-recommends {' '.join(missing)}")
        if os.geteuid() != 0:
            raise HostError("the EL test host needs root (mount, systemd-nspawn)")
        base = base_rootfs(self.progress)
        self.workdir.mkdir(parents=True, exist_ok=True)
        for sub in ("upper", "work", "root"):
            (self.workdir / sub).mkdir(exist_ok=True)
        if not os.path.ismount(self.root):
            _run(
                [
                    "mount",
                    "-t",
                    "overlay",
                    "overlay",
                    "-o",
                    f"lowerdir={base},upperdir={self.workdir / 'upper'},workdir={self.workdir / 'work'}",
                    str(self.root),
                ]
            )
        self._dress()

    def _write(self, rel: str, text: str, mode: int = 0o644) -> None:
        path = self.root / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.exists():
            path.unlink()
        path.write_text(text)
        path.chmod(mode)

    def _dress(self) -> None:
        w = self._write
        # Identity: TencentOS Server 3.1.
        w("/etc/os-release", OS_RELEASE)
        w("/usr/lib/os-release", OS_RELEASE)
        w("/etc/tencentos-release", "TencentOS Server release 3.1 (Final)\n")
        for alias in ("etc/redhat-release", "etc/system-release", "etc/centos-release"):
            link = self.root / alias
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to("tencentos-release")
        with contextlib.suppress(FileNotFoundError):
            (self.root / "etc/debian_version").unlink()
        w("/etc/hostname", "el8-gpu-node\n")
        # dnf: EL8's platform, the OS's own repository, no Debian sources.
        w(
            "/etc/dnf/dnf.conf",
            "[main]\ngpgcheck=1\ninstallonly_limit=3\nclean_requirements_on_remove=True\nbest=True\n"
            "skip_if_unavailable=False\nmodule_platform_id=platform:el8\nkeepcache=0\n",
        )
        w("/etc/dnf/vars/releasever", "8\n")
        w(
            "/etc/yum.repos.d/TencentOS-BaseOS.repo",
            f"[BaseOS]\nname=TencentOS Server $releasever - BaseOS\nbaseurl=file://{REPOS_IN_HOST}/baseos/$basearch\n"
            f"gpgcheck=1\ngpgkey=file://{REPOS_IN_HOST}/baseos/RPM-GPG-KEY-qgpu-elhost\nenabled=1\n",
        )
        # The plugins' code comes with the base, switched off; on EL8 the versionlock plugin comes
        # with python3-dnf-plugin-versionlock, whose config (the roles install it) switches it on.
        plugins = self.root / "etc/dnf/plugins"
        (plugins / "versionlock.list").unlink(missing_ok=True)
        for conf in plugins.glob("*.conf"):
            conf.write_text("[main]\nenabled = 0\n")
        # The runtime's virtualenv is filled from PyPI: the host trusts what this machine trusts
        # (a TLS-intercepting proxy's CA included), as a node in the same network would.
        bundle = Path("/etc/ssl/certs/ca-certificates.crt")
        if bundle.exists():
            w("/etc/ssl/certs/ca-certificates.crt", bundle.read_text())
            w("/etc/pip.conf", "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
        # Simulated kernel and GPUs.
        w("/etc/qgpu-sim/kernel", self.kernel + "\n")
        w("/etc/qgpu-sim/gpus", "".join(",".join(str(v) for v in gpu) + "\n" for gpu in self.gpus))
        w("/usr/local/libexec/qgpu-sim-kernel", SIM_KERNEL, 0o755)
        w("/etc/systemd/system/qgpu-sim-kernel.service", SIM_KERNEL_UNIT)
        wants = self.root / "etc/systemd/system/sysinit.target.wants"
        wants.mkdir(parents=True, exist_ok=True)
        link = wants / "qgpu-sim-kernel.service"
        if not link.is_symlink():
            link.symlink_to("/etc/systemd/system/qgpu-sim-kernel.service")
        w("/usr/bin/dracut", DRACUT, 0o755)
        (self.root / "lib/modules" / self.kernel).mkdir(parents=True, exist_ok=True)
        # ssh on 127.0.0.1 only, key login for root.
        if not self.key.exists():
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "qgpu-elhost", "-f", str(self.key)])
        w("/root/.ssh/authorized_keys", self.key.with_suffix(".pub").read_text(), 0o600)
        (self.root / "root/.ssh").chmod(0o700)
        w(
            "/etc/ssh/sshd_config.d/qgpu-elhost.conf",
            f"Port {self.port}\nListenAddress 127.0.0.1\nPermitRootLogin prohibit-password\nPasswordAuthentication no\nUseDNS no\n",
        )
        # No console getty (the console is a pipe), no machine-id clash with the base.
        with contextlib.suppress(FileNotFoundError):
            (self.root / "etc/systemd/system/getty.target.wants/getty@tty1.service").unlink()
        w("/etc/machine-id", "")

    # --- running ------------------------------------------------------------------------------
    def start(self, timeout: float = 120) -> None:
        self.boots_file.write_text("")
        log = open(self.workdir / "console.log", "ab")  # noqa: SIM115 (the supervisor owns it)
        self._supervisor = subprocess.Popen(
            [sys.executable, "-m", "tests.elhost.host", "supervise", str(self.root), str(self.repos), str(self.boots_file)],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 120, *, after_boot: int = 1) -> None:
        """Until the host's boot number `after_boot` answers on ssh with systemd up."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self._supervisor is not None and self._supervisor.poll() is not None:
                raise HostError(f"the host stopped (supervisor exit {self._supervisor.returncode}); console:\n{self.console()}")
            if self.boots() >= after_boot:
                proc = self.ssh("systemctl is-system-running --wait", check=False, timeout=60)
                last = proc.stdout.strip() + proc.stderr.strip()
                if proc.returncode == 0 or proc.stdout.strip() == "degraded":
                    return
            time.sleep(0.5)
        raise HostError(f"host not ready after {timeout:.0f} s (last answer {last!r}); console:\n{self.console()}")

    def boots(self) -> int:
        try:
            return len(self.boots_file.read_text().split())
        except FileNotFoundError:
            return 0

    def console(self, lines: int = 60) -> str:
        try:
            text = (self.workdir / "console.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def known_hosts(self) -> Path:
        """A known_hosts file naming this host's own keys (its root's ``/etc/ssh``), so ssh and
        Ansible check the host key as an operator's controller does (ansible.cfg
        ``host_key_checking``; docs/provisioning.md, "What the controller trusts")."""
        keys = sorted((self.root / "etc/ssh").glob("ssh_host_*_key.pub"))
        if not keys:
            raise HostError(f"no ssh host keys in {self.root / 'etc/ssh'}")
        path = self.workdir / "known_hosts"
        path.write_text("".join(f"[127.0.0.1]:{self.port} {' '.join(k.read_text().split()[:2])}\n" for k in keys))
        return path

    def ssh_args(self) -> list[str]:
        return [
            "ssh",
            "-i",
            str(self.key),
            "-p",
            str(self.port),
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"UserKnownHostsFile={self.known_hosts()}",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "ConnectTimeout=5",
            "root@127.0.0.1",
        ]

    def ssh(self, command: str, *, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        proc = subprocess.run([*self.ssh_args(), command], capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise HostError(f"on the host: {command!r} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def inventory(self, path: Path, host_vars: dict | None = None, *, standalone: bool = True) -> Path:
        """An inventory with this host as the only GPU node, a standalone qgpu host (no cluster:
        every Kubernetes group is empty) unless `standalone` is false."""
        import yaml

        hostvars = {
            "ansible_host": "127.0.0.1",
            "ansible_port": self.port,
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(self.key),
            "ansible_ssh_common_args": f"-o StrictHostKeyChecking=yes -o UserKnownHostsFile={self.known_hosts()}",
            "ansible_python_interpreter": "/usr/bin/python3",
            **(host_vars or {}),
        }
        groups = ("kube_control_plane", "qgpu_kube_api", "qgpu_kube_nodes")
        inv = {
            "all": {
                "children": {
                    "qgpu_gpu_nodes": {"hosts": {"el8-gpu-node": hostvars}},
                    "qgpu_standalone": {"hosts": {"el8-gpu-node": {}} if standalone else {}},
                    **{group: {"hosts": {}} for group in groups},
                }
            }
        }
        path.write_text(yaml.safe_dump(inv, sort_keys=False))
        return path

    def stop(self, timeout: float = 60) -> None:
        sup = self._supervisor
        if sup is not None and sup.poll() is None:
            sup.send_signal(signal.SIGTERM)
            try:
                sup.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(sup.pid, signal.SIGKILL)
                sup.wait(10)
        self._supervisor = None

    def remove(self) -> None:
        self.stop()
        if os.path.ismount(self.root):
            subprocess.run(["umount", "-l", str(self.root)], check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)

    @classmethod
    @contextlib.contextmanager
    def booted(cls, workdir: Path, repos: Path, **kw) -> Iterator[ElHost]:
        host = cls(workdir=workdir, repos=repos, **kw)
        try:
            host.prepare()
            host.start()
            yield host
        finally:
            host.remove()


def supervise(root: str, repos: str, boots_file: str) -> int:
    """Boot the machine; boot it again whenever it reboots (exit 133); stop on SIGTERM."""
    stopping = False
    child: subprocess.Popen | None = None

    def on_term(_sig, _frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)  # nspawn turns it into a clean poweroff of the machine

    signal.signal(signal.SIGTERM, on_term)
    parent = os.getppid()
    boot = 0
    while not stopping:
        boot += 1
        with open(boots_file, "a") as out:
            out.write(f"{boot}\n")
        print(f"=== supervisor: boot {boot}", flush=True)
        child = subprocess.Popen(
            [
                "systemd-nspawn",
                "--quiet",
                "--boot",
                f"--directory={root}",
                "--register=no",
                "--keep-unit",
                "--console=pipe",
                "--machine=el8-gpu-node",
                f"--bind-ro={repos}:{REPOS_IN_HOST}",
                "--resolv-conf=off",
                "--timezone=off",
            ],
            stdin=subprocess.DEVNULL,
        )
        code = _wait_or_orphaned(child, parent)
        print(f"=== supervisor: boot {boot} ended with {code}", flush=True)
        if os.getppid() != parent:  # the test run died without stopping the host: leave nothing behind
            subprocess.run(["umount", "-l", root], check=False)
            return 0
        if code != EXIT_REBOOT:
            return 0 if stopping else code
    return 0


def _wait_or_orphaned(child: subprocess.Popen, parent: int) -> int:
    """The machine's exit status; a clean poweroff first if the process that started us is gone."""
    while True:
        try:
            return child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            if os.getppid() != parent and child.poll() is None:
                child.send_signal(signal.SIGTERM)
                try:
                    return child.wait(60)
                except subprocess.TimeoutExpired:
                    child.kill()
                    return child.wait()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "supervise":
        sys.exit(supervise(*sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} supervise ROOT REPOS BOOTS_FILE")
