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
# The tests run on QGPU_TEST_WORKERS pytest-xdist workers (default 3): most of a test's time is
# spent waiting on a control plane, a kubelet or a playbook, not on the CPU. A worker takes a whole
# group at a time (a module; every real-node test; the EL8 host's tests), the longest groups first
# (tests/conftest.py, docs/testing.md "Workers"). QGPU_TEST_WORKERS=0 runs them in this process.
# The full run lists its 50 slowest tests at the end: CI's 90-minute limit is watched from there.
workers=${QGPU_TEST_WORKERS:-3}
case "$workers" in
  ''|*[!0-9]*) echo "test.sh: QGPU_TEST_WORKERS=$workers: expected a whole number of workers (0 runs the tests in one process)" >&2; exit 2 ;;
esac
parallel=()
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist loadscope)
durations=()
[ -n "$fast" ] || durations=(--durations=50 -v)
exec .venv/bin/python -m pytest $fast "${parallel[@]}" "${durations[@]}" "$@"
