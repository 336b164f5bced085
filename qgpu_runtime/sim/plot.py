"""Drawing replay curves beside the FGD study's published ones."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Sequence

PUBLISHED_POLICIES = {"05-BestFit": "published BestFit", "06-FGD": "published FGD"}


def published_curves(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Median over seeds of unallocated GPU % per arrived %, for BestFit and FGD of the study."""
    with path.open(newline="") as handle:
        rows = list(csv.reader(handle))
    header = rows[0]
    columns = [(i, int(h)) for i, h in enumerate(header) if h.isdigit()]
    by_policy: dict[str, list[list[float]]] = {}
    for row in rows[1:]:
        if row[1] in PUBLISHED_POLICIES:
            by_policy.setdefault(row[1], []).append([100.0 - float(row[i]) for i, _ in columns])
    return {
        PUBLISHED_POLICIES[name]: [(pct, statistics.median(seed[k] for seed in seeds)) for k, (_, pct) in enumerate(columns)]
        for name, seeds in by_policy.items()
    }


def plot_curves(summaries: Sequence, out: Path, expected: Path | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for s in summaries:
        points = [(pct, v) for pct, v in enumerate(s.curve) if v is not None and pct >= 50]
        ax.plot([p for p, _ in points], [v for _, v in points], label=f"qgpu {s.policy}")
    if expected is not None and expected.exists():
        for label, points in published_curves(expected).items():
            points = [(p, v) for p, v in points if p >= 50]
            ax.plot([p for p, _ in points], [v for _, v in points], linestyle="--", label=label)
    ax.set_xlabel("arrived GPU demand (% of cluster capacity)")
    ax.set_ylabel("unallocated GPU (% of capacity)")
    ax.set_title("Trace replay: unallocated GPU vs arrived demand (median over seeds)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
