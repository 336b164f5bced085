#!/usr/bin/env bash
# The main job on the local default: provisions this machine as a standalone qgpu host with
# Ansible (site.yml on inventories/local): preflight report, driver/CUDA/toolkit decisions, the
# runtime built from this checkout, the standalone manager on simulated GPUs, a smoke workload
# and `qgpu status`. Everything it writes lands under .cache/local-root; a second run changes nothing.
# Extra arguments go to ansible-playbook (e.g. -v, --check, -e qgpu_simulated_gpus=4xT4-16G).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/bootstrap.sh
export ANSIBLE_CONFIG="$root/ansible.cfg"
exec .venv/bin/ansible-playbook -i inventories/local playbooks/site.yml "$@"
