"""POSIX sh stand-ins shipped inside the test RPMs of tests/elhost/repo.py.

Each is a template: ``@V@`` is the package version. The simulated kernel state (what the test
host writes at boot) lives under ``$QGPU_SIM`` (default ``/run/qgpu-sim``):

- ``sys/module/nvidia/version``: the loaded module's version; absent = no module loaded;
- ``gpus``: one line per GPU, ``index,name,memory_mib,pci_bus_id,uuid``.

``dkms`` works under ``$QGPU_ELHOST_ROOT`` (default ``""``, the real root) so a test can run the
installed script against an installroot without chroot.
"""

from __future__ import annotations

# CUDA version each driver branch reports in nvidia-smi's banner (the driver's own, not a toolkit's).
CUDA_OF_BRANCH = {"450": "11.0", "465": "11.3", "470": "11.4", "495": "11.5"}

NVIDIA_SMI = r"""#!/bin/sh
# qgpu stand-in for nvidia-smi of driver @V@ (tests/elhost/standins.py): reads the simulated
# kernel state under $QGPU_SIM (default /run/qgpu-sim) written by the test host at boot.
VERSION=@V@
CUDA=@CUDA@
SIM="${QGPU_SIM:-/run/qgpu-sim}"
if [ ! -r "$SIM/sys/module/nvidia/version" ]; then
    echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."
    exit 9
fi
loaded=$(tr -d ' \t\r\n' < "$SIM/sys/module/nvidia/version")
if [ "$loaded" != "$VERSION" ]; then
    echo "Failed to initialize NVML: Driver/library version mismatch"
    exit 18
fi
GPUS="$SIM/gpus"
[ -r "$GPUS" ] || GPUS=/dev/null

mode=table query= format=csv
for arg in "$@"; do
    case $arg in
        -L|--list-gpus) mode=list ;;
        --query-gpu=*) mode=query; query=${arg#--query-gpu=} ;;
        --format=*) format=${arg#--format=} ;;
        *) echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."; exit 2 ;;
    esac
done

field() {  # field NAME: the value of one --query-gpu field for the current GPU line
    case $1 in
        index) printf '%s' "$idx" ;;
        name|gpu_name) printf '%s' "$name" ;;
        driver_version) printf '%s' "$VERSION" ;;
        memory.total) if [ "$nounits" = 1 ]; then printf '%s' "$mem"; else printf '%s MiB' "$mem"; fi ;;
        pci.bus_id|gpu_bus_id) printf '%s' "$bus" ;;
        uuid|gpu_uuid) printf '%s' "$uuid" ;;
        count) printf '%s' "$count" ;;
        *) return 1 ;;
    esac
}

count=$(grep -c . "$GPUS" 2>/dev/null || true)
case $mode in
list)
    while IFS=, read -r idx name mem bus uuid; do
        [ -n "$idx" ] || continue
        echo "GPU $idx: $name (UUID: $uuid)"
    done < "$GPUS"
    ;;
query)
    noheader=0 nounits=0
    case ",$format," in *,noheader,*) noheader=1 ;; esac
    case ",$format," in *,nounits,*) nounits=1 ;; esac
    fields=$(echo "$query" | tr ',' ' ')
    for f in $fields; do
        case $f in
            index|name|gpu_name|driver_version|memory.total|pci.bus_id|gpu_bus_id|uuid|gpu_uuid|count) ;;
            *) echo "Field \"$f\" is not a valid field to query."; exit 2 ;;
        esac
    done
    if [ "$noheader" = 0 ]; then
        line=
        for f in $fields; do
            h=$f
            [ "$f" = memory.total ] && [ "$nounits" = 0 ] && h="memory.total [MiB]"
            line="${line:+$line, }$h"
        done
        echo "$line"
    fi
    while IFS=, read -r idx name mem bus uuid; do
        [ -n "$idx" ] || continue
        line= first=1
        for f in $fields; do
            v=$(field "$f")
            if [ "$first" = 1 ]; then line=$v; first=0; else line="$line, $v"; fi
        done
        echo "$line"
    done < "$GPUS"
    ;;
table)
    echo "+-----------------------------------------------------------------------------+"
    printf '| NVIDIA-SMI %-18s Driver Version: %-14s CUDA Version: %-8s |\n' "$VERSION" "$VERSION" "$CUDA"
    echo "|-------------------------------+----------------------+----------------------+"
    echo "| GPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |"
    echo "|===============================+======================+======================|"
    while IFS=, read -r idx name mem bus uuid; do
        [ -n "$idx" ] || continue
        printf '| %3s  %-24s | %-20s | %6s MiB            |\n' "$idx" "$name" "$bus" "$mem"
    done < "$GPUS"
    echo "+-----------------------------------------------------------------------------+"
    ;;
esac
exit 0
"""

NVIDIA_PERSISTENCED = r"""#!/bin/sh
# qgpu stand-in for nvidia-persistenced of driver @V@ (tests/elhost/standins.py).
SIM="${QGPU_SIM:-/run/qgpu-sim}"
if [ ! -r "$SIM/sys/module/nvidia/version" ]; then
    echo "nvidia-persistenced failed to initialize. Check syslog for more details." >&2
    exit 1
fi
foreground=0
for arg in "$@"; do
    case $arg in
        -f|--foreground) foreground=1 ;;
        -v|--version) echo "nvidia-persistenced:  version @V@"; exit 0 ;;
    esac
done
PIDDIR=/run/nvidia-persistenced
run() {
    mkdir -p "$PIDDIR"
    echo $$ > "$PIDDIR/nvidia-persistenced.pid"
    child=
    trap 'rm -f "$PIDDIR/nvidia-persistenced.pid"; [ -n "$child" ] && kill "$child" 2>/dev/null; exit 0' TERM INT
    while :; do
        sleep 3600 &
        child=$!
        wait "$child"
    done
}
if [ "$foreground" = 1 ]; then
    run
else
    run </dev/null >/dev/null 2>&1 &
fi
exit 0
"""

NVIDIA_MODPROBE = """#!/bin/sh
# qgpu stand-in for nvidia-modprobe of driver @V@: the device nodes are the test host's business.
exit 0
"""

DKMS_CONF = """PACKAGE_NAME="nvidia"
PACKAGE_VERSION="@V@"
AUTOINSTALL="yes"
BUILT_MODULE_NAME[0]="nvidia"
DEST_MODULE_LOCATION[0]="/extra"
BUILT_MODULE_NAME[1]="nvidia-uvm"
DEST_MODULE_LOCATION[1]="/extra"
BUILT_MODULE_NAME[2]="nvidia-modeset"
DEST_MODULE_LOCATION[2]="/extra"
"""

# The "modules" are text files holding "<module> <version>": the test host reads them to decide
# which version a (simulated) reboot loads.
DKMS = r"""#!/bin/sh
# qgpu stand-in for DKMS (tests/elhost/standins.py): add / install / remove / status of a module
# whose "build" writes text files "<module> <version>" as <name>.ko.xz.
R="${QGPU_ELHOST_ROOT:-}"
TREE="$R/var/lib/dkms"
ARCH=x86_64
MODULES="nvidia nvidia-uvm nvidia-modeset"

cmd=${1:-}
[ $# -gt 0 ] && shift
module= version= kernels= all=0
while [ $# -gt 0 ]; do
    case $1 in
        -m) module=${2%%/*}; case $2 in */*) version=${2#*/} ;; esac; shift 2 ;;
        -v) version=$2; shift 2 ;;
        -k) kernels="$kernels ${2%%/*}"; shift 2 ;;
        -a|--arch) shift 2 ;;
        --all) all=1; shift ;;
        --rpm_safe_upgrade|-q|--quiet|--force|--no-depmod|--no-initrd|--verbose) shift ;;
        -*) echo "Error! Unknown option: $1" >&2; exit 2 ;;
        */*) module=${1%%/*}; version=${1#*/}; shift ;;
        *) echo "Error! Unknown argument: $1" >&2; exit 2 ;;
    esac
done

need_module() {
    if [ -z "$module" ] || [ -z "$version" ]; then
        echo "Error! Invalid number of arguments passed. Usage: $cmd <module>/<module-version> or $cmd -m <module>/<module-version>" >&2
        exit 1
    fi
}

no_headers() {
    echo "Error! Your kernel headers for kernel $1 cannot be found at /lib/modules/$1/build or /lib/modules/$1/source." >&2
}

case $cmd in
add)
    need_module
    if [ ! -f "$R/usr/src/$module-$version/dkms.conf" ]; then
        echo "Error! Could not find module source directory. Directory: /usr/src/$module-$version does not exist." >&2
        exit 1
    fi
    mkdir -p "$TREE/$module/$version"
    ln -sfn "/usr/src/$module-$version" "$TREE/$module/$version/source"
    echo "Creating symlink $TREE/$module/$version/source -> /usr/src/$module-$version"
    ;;
build|install)
    need_module
    if [ ! -e "$TREE/$module/$version/source" ] && [ ! -L "$TREE/$module/$version/source" ]; then
        echo "Error! The module/version combo: $module-$version is not located in the DKMS tree." >&2
        exit 3
    fi
    if [ -z "$kernels" ]; then
        for mk in "$R"/usr/src/kernels/*/Makefile; do
            [ -f "$mk" ] || continue
            k=${mk%/Makefile}
            kernels="$kernels ${k##*/}"
        done
    fi
    if [ -z "$kernels" ]; then
        no_headers "$(uname -r)"
        exit 1
    fi
    rc=0
    for k in $kernels; do
        if [ ! -f "$R/usr/src/kernels/$k/Makefile" ]; then
            no_headers "$k"
            rc=1
            continue
        fi
        built="$TREE/$module/$version/$k/$ARCH/module"
        mkdir -p "$built"
        for m in $MODULES; do
            echo "$module $version" > "$built/$m.ko.xz"
        done
        echo "Building module(s)... done."
        [ "$cmd" = build ] && continue
        mkdir -p "$R/lib/modules/$k/extra"
        for m in $MODULES; do
            cp "$built/$m.ko.xz" "$R/lib/modules/$k/extra/$m.ko.xz"
        done
        echo "$module.ko.xz: Installing module to /lib/modules/$k/extra/"
    done
    exit $rc
    ;;
remove|uninstall)
    need_module
    if [ ! -d "$TREE/$module/$version" ]; then
        echo "Error! The module/version combo: $module-$version is not located in the DKMS tree." >&2
        exit 3
    fi
    if [ "$all" = 0 ] && [ -z "$kernels" ]; then
        echo "Error! Please specify a kernel version (-k) or --all to $cmd $module/$version." >&2
        exit 1
    fi
    # Only this version's modules go: on an upgrade the new package's %post (which installs the
    # new version's) runs before the old one's %preun.
    for f in "$R"/lib/modules/*/extra/$module*.ko.xz; do
        [ -f "$f" ] || continue
        k=${f%/extra/*}
        k=${k##*/}
        if [ "$all" = 0 ]; then
            case " $kernels " in *" $k "*) ;; *) continue ;; esac
        fi
        [ "$(cat "$f")" = "$module $version" ] && rm -f "$f"
    done
    if [ "$cmd" = remove ] && [ "$all" = 1 ]; then
        rm -rf "${TREE:?}/$module/$version"
        rmdir "$TREE/$module" 2>/dev/null || true
    else
        for k in $kernels; do rm -rf "${TREE:?}/$module/$version/$k"; done
    fi
    echo "Deleting module $module-$version completely from the DKMS tree."
    ;;
status)
    for vdir in "$TREE"/*/*; do
        [ -d "$vdir" ] || continue
        v=${vdir##*/}
        m=${vdir%/*}
        m=${m##*/}
        [ -n "$module" ] && [ "$m" != "$module" ] && continue
        found=0
        for kdir in "$vdir"/*; do
            [ -d "$kdir/$ARCH/module" ] || continue
            found=1
            k=${kdir##*/}
            state=built
            if [ -f "$R/lib/modules/$k/extra/$m.ko.xz" ] && [ "$(cat "$R/lib/modules/$k/extra/$m.ko.xz")" = "$m $v" ]; then
                state=installed
            fi
            echo "$m/$v, $k, $ARCH: $state"
        done
        [ "$found" = 1 ] || echo "$m/$v: added"
    done
    ;;
autoinstall)
    for vdir in "$TREE"/*/*; do
        [ -e "$vdir/source" ] || [ -L "$vdir/source" ] || continue
        v=${vdir##*/}
        m=${vdir%/*}
        "$0" install -m "${m##*/}" -v "$v" ${kernels:+-k $kernels} || exit $?
    done
    ;;
--version|-V)
    echo "dkms-@V@"
    ;;
*)
    echo "Error! Unknown action: $cmd (qgpu stand-in knows add, build, install, remove, uninstall, status, autoinstall)" >&2
    exit 2
    ;;
esac
exit 0
"""

NVCC = """#!/bin/sh
# qgpu stand-in for nvcc @V@.
case "${1:-}" in
    --version|-V)
        echo "nvcc: NVIDIA (R) Cuda compiler driver"
        echo "Copyright (c) 2005-2021 NVIDIA Corporation"
        echo "Built on Sun_Mar_21_19:15:46_PDT_2021"
        echo "Cuda compilation tools, release @MM@, V@V@"
        echo "Build cuda_@MM@.r@MM@/compiler.29745058_0"
        ;;
    *) echo "nvcc fatal   : No input files specified; use option --help for more information"; exit 1 ;;
esac
"""

NVIDIA_CONTAINER_CLI = """#!/bin/sh
# qgpu stand-in for nvidia-container-cli @V@.
case "${1:-}" in
    --version|-V)
        echo "cli-version: @V@"
        echo "lib-version: @V@"
        echo "build date: 2025-06-01T00:00+00:00"
        ;;
    info)
        SIM="${QGPU_SIM:-/run/qgpu-sim}"
        if [ ! -r "$SIM/sys/module/nvidia/version" ]; then
            echo "nvidia-container-cli: initialization error: nvml error: driver not loaded" >&2
            exit 1
        fi
        echo "NVRM version:   $(cat "$SIM/sys/module/nvidia/version")"
        ;;
    *) echo "cli-version: @V@" ;;
esac
"""

NVIDIA_CTK = """#!/bin/sh
# qgpu stand-in for nvidia-ctk @V@.
case "${1:-}" in
    --version|-v|version)
        echo "NVIDIA Container Toolkit CLI version @V@"
        echo "commit: 0000000000000000000000000000000000000000"
        ;;
    *) echo "NVIDIA Container Toolkit CLI version @V@" ;;
esac
"""

NVIDIA_CONTAINER_RUNTIME = """#!/bin/sh
# qgpu stand-in for nvidia-container-runtime @V@: a runc wrapper.
case "${1:-}" in
    --version|-v)
        echo "NVIDIA Container Runtime version @V@"
        echo "commit: 0000000000000000000000000000000000000000"
        echo "spec: 1.2.0"
        exit 0
        ;;
esac
exec runc "$@"
"""

NVIDIA_CONTAINER_RUNTIME_HOOK = """#!/bin/sh
# qgpu stand-in for nvidia-container-runtime-hook @V@.
exit 0
"""


def render(template: str, **values: str) -> str:
    """``template`` with each ``@KEY@`` replaced by ``values[KEY]`` (``V`` is the version)."""
    for key, value in values.items():
        template = template.replace(f"@{key}@", value)
    return template
