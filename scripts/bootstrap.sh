#!/usr/bin/env bash
# Creates (or reuses) the project's virtualenv in .venv and installs qgpu with its dev extras.
# Re-installs only when pyproject.toml changed since the last install, so repeated runs are quick.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${QGPU_PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "bootstrap: $python is $("$python" --version 2>&1); qgpu needs Python >= 3.11 (set QGPU_PYTHON)" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating virtualenv in .venv" >&2
  "$python" -m venv .venv
fi
stamp=.venv/.qgpu-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing qgpu and its dev dependencies into .venv" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
