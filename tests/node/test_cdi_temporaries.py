"""A CDI spec write leaves no temporary file behind, whether it fails or is killed (issue 21 §7).

The CDI folder is shared with the runtime and other vendors: the start-up clean-up removes only
the temporary files qgpu's writer names, never another file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qgpu_runtime.node.dra import cdi


def test_a_write_that_fails_leaves_no_temporary_and_the_old_spec(tmp_path: Path) -> None:
    path = cdi.spec_path(tmp_path, "uid-1")
    cdi.write_spec(path, {"kind": cdi.KIND, "devices": []})
    with pytest.raises(TypeError):
        cdi.write_spec(path, {"kind": cdi.KIND, "devices": [object()]})  # fails half-way through json.dump
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert cdi.read_spec(path) == {"kind": cdi.KIND, "devices": []}


def _killed_writer(cdi_dir: Path) -> Path:
    """Run a writer that is SIGKILLed after writing its temporary file, before the rename."""
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from qgpu_runtime.node.dra import cdi
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        cdi.write_spec(cdi.spec_path(Path({str(cdi_dir)!r}), "uid-killed"), {{"kind": cdi.KIND}})
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], check=False)
    assert done.returncode == -signal.SIGKILL
    (left,) = [p for p in cdi_dir.iterdir() if p.name.startswith(".")]
    return left


def test_the_plugin_start_removes_what_a_killed_write_left_and_nothing_else(tmp_path: Path) -> None:
    from qgpu_runtime.node.dra.preparer import ClaimPreparer
    from qgpu_runtime.node.dra.settings import DraSettings
    from qgpu_runtime.node.store import Store
    from tests.node.test_draplugin import CARDS, NODE, Claims  # the DRA test node: two simulated cards

    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    left = _killed_writer(cdi_dir)
    assert left.name.startswith(f".{cdi.spec_path(cdi_dir, 'uid-killed').name}.tmp")
    keep = [cdi_dir / ".nvidia.com-gpu_x.json.tmp12", cdi_dir / "nvidia.yaml", cdi.spec_path(cdi_dir, "uid-2"),
            cdi_dir / ".gpu.qgpu.io-claim_uid-3.json.tmpX"]
    for other in keep:
        other.write_text("{}")
    store = Store(tmp_path / "meta.db")
    try:
        ClaimPreparer(DraSettings(NODE, cdi_dir=cdi_dir), CARDS, store, Claims(), lambda: "fixed-share")
    finally:
        store.close()
    assert not left.exists()
    assert sorted(p.name for p in cdi_dir.iterdir()) == sorted(p.name for p in keep)


def test_the_pattern_is_the_writers_own(tmp_path: Path) -> None:
    path = cdi.spec_path(tmp_path, "uid-1")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("half")
    assert cdi.remove_stale_temporaries(tmp_path) == [tmp]
    assert cdi.remove_stale_temporaries(tmp_path / "absent") == []
