"""Every role's molecule `default` scenario: converge, idempotence (a second converge changes
nothing), verify, cleanup, on localhost with everything under the scenario's temporary root."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_tools import BIN, REPO, ROLES, run_tool


def test_every_role_has_a_scenario() -> None:
    roles = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "tasks/main.yml").exists())
    assert roles == ROLES


@pytest.mark.slow
@pytest.mark.parametrize("role", ROLES)
def test_role_converges_idempotently_and_verifies(role: str, tmp_path: Path) -> None:
    run = run_tool([str(BIN / "molecule"), "test"], cwd=REPO / "roles" / role,
                   MOLECULE_EPHEMERAL_DIRECTORY=str(tmp_path / "molecule"))
    assert run.returncode == 0, run.output[-6000:]
    for step in ("converge", "idempotence", "verify", "cleanup"):
        assert f"default > {step}: Executed: Successful" in run.output, f"{step} did not run:\n{run.output[-3000:]}"
