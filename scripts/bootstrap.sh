#!/usr/bin/env bash
# Creates (or reuses) the project's virtualenv in .venv and installs qgpu with its dev extras.
# Re-installs only when pyproject.toml changed since the last install, so repeated runs are quick.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# The interpreter: $QGPU_PYTHON when set; otherwise the distribution's /usr/bin/python3 when it is
# 3.11 or newer and can make virtualenvs, else the first python3 on PATH. A distribution's build is
# compiled with profile-guided and link-time optimisation, which a pyenv build is not by default:
# on the 2-core dev container Debian's 3.11 runs an Ansible module in 0.30 s against 0.40 s for
# pyenv's 3.11.7, and the whole suite is mostly Python (docs/testing.md, "Which Python").
python=${QGPU_PYTHON:-}
if [ -z "$python" ]; then
  python=python3
  if /usr/bin/python3 -c 'import sys, venv, ensurepip; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
    python=/usr/bin/python3
  fi
fi
if ! "$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "bootstrap: $python is $("$python" --version 2>&1); qgpu needs Python >= 3.11 (set QGPU_PYTHON)" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating virtualenv in .venv with $python ($("$python" --version 2>&1))" >&2
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
