"""Every role option that carries a secret (a private key's PEM, a token, a password) is marked
``no_log`` in the role's argument spec, so Ansible's argument validation never prints its value."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROLES = Path(__file__).resolve().parents[2] / "roles"
SECRET = re.compile(r"(_key_pem|_token|_password)$")


def test_every_secret_option_is_no_log():
    secrets, unmarked = [], []
    for spec_file in sorted(ROLES.glob("*/meta/argument_specs.yml")):
        for entry in (yaml.safe_load(spec_file.read_text()).get("argument_specs") or {}).values():
            for name, option in (entry.get("options") or {}).items():
                if SECRET.search(name):
                    secrets.append(name)
                    if option.get("no_log") is not True:
                        unmarked.append(f"{spec_file.relative_to(ROLES)}: {name}")
    assert "kube_scheduler_extender_client_key_pem" in secrets  # the pattern finds the options it is for
    assert unmarked == []
