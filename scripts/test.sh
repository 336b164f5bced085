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
# The layers (import-linter contracts in pyproject.toml, docs/architecture.md "Layers") and the
# lint rules (ruff) first: a violation fails the run before any test starts.
echo "test.sh: ruff check" >&2
.venv/bin/ruff check qgpu_runtime tests bench
echo "test.sh: lint-imports (layers of docs/architecture.md)" >&2
.venv/bin/lint-imports --no-cache
exec .venv/bin/python -m pytest "$@"
