#!/usr/bin/env bash
# Runs every test of the project: installs what is missing first (virtualenv, packages, binaries).
# `scripts/test.sh --fast [pytest args]`: the fast tier only (docs/testing.md#the-tiers), for
# iterating: no control plane, real node or Ansible run, so nothing of theirs is built either.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
fast=
if [ "${1:-}" = --fast ]; then
  fast=--fast
  shift
fi
scripts/bootstrap.sh
# The real Kubernetes components and containerd the tests run (cached by version; slow only once),
# and, as root, the Debian packages of a real node (runc, debootstrap, ...). The fast tier starts
# none of them.
if [ -n "$fast" ]; then
  echo "test.sh: fast tier: Kubernetes binaries, containerd and the real node's packages not built" >&2
elif [ "$(id -u)" = 0 ]; then
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
# The full run lists its 50 slowest tests at the end: CI's 90-minute limit is watched from there.
durations=
[ -n "$fast" ] || durations=--durations=50
exec .venv/bin/python -m pytest $fast $durations "$@"
