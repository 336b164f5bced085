#!/usr/bin/env bash
# Runs every test of the project: installs what is missing first (virtualenv, packages).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/bootstrap.sh
# The real control plane the extender/webhook tests run against (cached by version; slow only once).
scripts/k8s-testbin >/dev/null
exec .venv/bin/python -m pytest "$@"
