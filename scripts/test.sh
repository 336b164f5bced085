#!/usr/bin/env bash
# Runs every test of the project: installs what is missing first (virtualenv, packages, binaries).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/bootstrap.sh
# The real Kubernetes components and containerd the tests run (cached by version; slow only once),
# and, as root, the Debian packages of a real node (runc, debootstrap, ...).
if [ "$(id -u)" = 0 ]; then
  scripts/local-cluster-deps
else
  scripts/k8s-testbin >/dev/null
  scripts/containerd-bin >/dev/null
fi
exec .venv/bin/python -m pytest "$@"
