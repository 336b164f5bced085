"""The real control plane of tests/k8s for the provisioning tests that speak Kubernetes.

Importing the session fixture here gives tests/provisioning its own control plane (one per
conftest that defines it), so the objects site.yml creates — a fail-closed admission webhook
among them — never reach the extender and webhook tests of tests/k8s.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `pytest tests/provisioning` without `python -m`
    sys.path.insert(0, str(ROOT))

from tests.k8s.conftest import cluster  # noqa: E402,F401  (re-exported fixture)
