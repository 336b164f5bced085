"""Every role's molecule `default` scenario: converge, idempotence (a second converge changes
nothing), verify, cleanup, on localhost with everything under the scenario's temporary root.

The scenarios share nothing but the checkout (each has its own ephemeral directory and sandbox
root, none starts a service or listens on a port), so the selected ones run two at a time on the
two-core machine (all twelve: 267 s in the full run of 2026-11-28, docs/testing.md). The two that build this checkout's wheel
(qgpu_image, qgpu_runtime) never run at the same time as each other.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ansible_tools import BIN, REPO, ROLES, Run, run_tool

PARALLEL = 2
BUILDS_THE_CHECKOUT = {"qgpu_image", "qgpu_runtime"}
STEPS = ("converge", "idempotence", "verify", "cleanup")


def test_every_role_has_a_scenario() -> None:
    roles = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "tasks/main.yml").exists())
    assert roles == ROLES


def molecule_test(role: str, work: Path, checkout: threading.Lock) -> Run:
    def run() -> Run:
        return run_tool([str(BIN / "molecule"), "test"], cwd=REPO / "roles" / role, timeout=1200,
                        MOLECULE_EPHEMERAL_DIRECTORY=str(work / "molecule"))
    if role in BUILDS_THE_CHECKOUT:
        with checkout:
            return run()
    return run()


@pytest.fixture(scope="module")
def scenarios(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The molecule run of every role this session selected (`-k qgpu_manager` runs one)."""
    selected = sorted({item.callspec.params["role"] for item in request.session.items
                       if item.originalname == "test_role_converges_idempotently_and_verifies"})
    checkout = threading.Lock()
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        futures = {role: pool.submit(molecule_test, role, tmp_path_factory.mktemp(f"molecule-{role}"), checkout)
                   for role in selected}
        return {role: future.result() for role, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("role", ROLES)
def test_role_converges_idempotently_and_verifies(role: str, scenarios: dict[str, Run]) -> None:
    run = scenarios[role]
    assert run.returncode == 0, run.output[-6000:]
    for step in STEPS:
        assert f"default > {step}: Executed: Successful" in run.output, f"{step} did not run:\n{run.output[-3000:]}"
