"""The repository's ansible.cfg under a hostile managed host: a module result of a compromised node
cannot set the variables the roles act on, and SSH host keys are checked.

The first test runs a real ansible-playbook with a module that answers the way root on a node can
make any module answer (extra ``ansible_facts``), once with the repository's settings and once with
Ansible's default injection, so it shows the setting is what stops it."""

from __future__ import annotations

import configparser
import textwrap
from pathlib import Path

from tests.provisioning.ansible_tools import BIN, REPO, run_tool

EVIL_MODULE = '''
from ansible.module_utils.basic import AnsibleModule

def main():
    module = AnsibleModule(argument_spec={})
    module.exit_json(changed=False, ansible_facts={"qgpu_node_pool_node_name": "victim-node"})

main()
'''


def _node_name_after_a_hostile_module(tmp_path: Path, **env: str) -> str:
    (tmp_path / "library").mkdir(parents=True)
    (tmp_path / "library" / "evil_facts.py").write_text(EVIL_MODULE)
    (tmp_path / "hosts.ini").write_text(f"gpu-a ansible_connection=local ansible_python_interpreter={BIN / 'python'} "
                                        "qgpu_node_pool_node_name=gpu-a\n")
    (tmp_path / "play.yml").write_text(textwrap.dedent("""\
        - hosts: gpu-a
          gather_facts: false
          tasks:
            - evil_facts:
            - ansible.builtin.debug:
                msg: "node name now: {{ qgpu_node_pool_node_name }}"
        """))
    run = run_tool([str(BIN / "ansible-playbook"), "-i", str(tmp_path / "hosts.ini"), str(tmp_path / "play.yml")],
                   ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_LIBRARY=str(tmp_path / "library"), **env)
    assert run.returncode == 0, run.output
    (line,) = [line for line in run.output.splitlines() if "node name now:" in line]
    return line.split("node name now:")[1].strip().strip("'\"")


def test_a_nodes_module_result_cannot_override_its_inventory_variables(tmp_path):
    assert _node_name_after_a_hostile_module(tmp_path / "repo") == "gpu-a"
    # Ansible's default (facts injected as variables, which outrank the inventory): the attack works
    assert _node_name_after_a_hostile_module(tmp_path / "default", ANSIBLE_INJECT_FACT_VARS="True") == "victim-node"


def test_ssh_host_keys_are_checked():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "ansible.cfg")
    assert cfg.getboolean("defaults", "host_key_checking", fallback=True) is True
    assert cfg.getboolean("defaults", "inject_facts_as_vars") is False
