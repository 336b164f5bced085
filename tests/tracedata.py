"""Where the bundled openb trace lives: ``$QGPU_TRACE_DIR``, else ``../shared/data/gpu-trace-v2023``
beside the checkout, or beside the main checkout when this one is a git worktree, or the
workspace's ``/work/shared/data/gpu-trace-v2023``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path("shared") / "data" / "gpu-trace-v2023"


def _main_checkout() -> Path | None:
    try:
        common = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--path-format=absolute", "--git-common-dir"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(common).parent if common else None


def openb_trace_dir() -> Path | None:
    """The folder holding openb_node_list_gpu_node.csv and openb_pod_list_default.csv, or None."""
    candidates = [Path(os.environ["QGPU_TRACE_DIR"])] if os.environ.get("QGPU_TRACE_DIR") else []
    candidates.append(ROOT.parent / TRACE)
    main = _main_checkout()
    if main is not None:
        candidates.append(main.parent / TRACE)
    # A clone made elsewhere (CI clones the repository away from its workspace): the workspace's
    # shared data, where this project's machines keep it.
    candidates.append(Path("/work") / TRACE)
    for folder in candidates:
        if (folder / "openb_node_list_gpu_node.csv").is_file() and (folder / "openb_pod_list_default.csv").is_file():
            return folder
    return None
