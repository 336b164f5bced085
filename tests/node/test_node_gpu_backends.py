"""GPU backends: the simulated one chosen on purpose, NVML failing loudly, NVML on a real card."""

from __future__ import annotations

import shutil

import pytest

from qgpu_runtime.cli import main
from qgpu_runtime.gpu import BackendError, open_backend
from qgpu_runtime.gpu.simulated import SimulatedBackend, parse_spec


def test_spec_strings_give_cards_with_stable_uuids():
    a = SimulatedBackend.from_option("2xT4-16G,1xA100-80G", "node-a").cards()
    b = SimulatedBackend.from_option("2xT4-16G,1xA100-80G", "node-a").cards()
    assert [(c.index, c.model, c.memory_mib) for c in a] == [(0, "T4", 16384), (1, "T4", 16384), (2, "A100", 81920)]
    assert a == b and len({c.uuid for c in a}) == 3


def test_bad_spec_names_the_part_and_the_rule():
    with pytest.raises(ValueError, match=r"'3xT4' is not a card spec: write COUNTxMODEL-MEMORY"):
        parse_spec("2xT4-16G,3xT4")


def test_config_file_with_control_file(tmp_path):
    (tmp_path / "gpus.yaml").write_text("cards:\n  - {model: V100, memory_mib: 32768, count: 2}\ncontrol: ctl.json\n")
    (tmp_path / "ctl.json").write_text('{"usage": {"1": {"util_pct": 40, "memory_used_mib": 100}}, "unhealthy": {"0": "XID 79"}}')
    backend = SimulatedBackend.from_option(str(tmp_path / "gpus.yaml"), "n")
    assert [s.util_pct for s in backend.sample()] == [0, 40]
    assert [(e.card_index, e.reason) for e in backend.wait_health_events(0.01)] == [(0, "XID 79")]
    assert backend.wait_health_events(0.01) == []  # reported once
    (tmp_path / "ctl.json").write_text('{"unhealthy": {}}')  # the card was reset
    assert [(e.card_index, e.healthy) for e in backend.wait_health_events(0.01)] == [(0, True)]
    assert backend.wait_health_events(0.01) == []
    (tmp_path / "ctl.json").write_text('{"unhealthy": {"0": "XID 48"}}')  # and fails again
    assert [(e.card_index, e.reason, e.healthy) for e in backend.wait_health_events(0.01)] == [(0, "XID 48", False)]


def test_simulated_is_never_implied():
    with pytest.raises(ValueError, match="--gpu-backend simulated needs --simulated-gpus"):
        open_backend("simulated", None, "n")
    with pytest.raises(ValueError, match="choose --gpu-backend simulated to use it"):
        open_backend("nvml", "2xT4-16G", "n")


def test_manager_refuses_to_start_with_a_bad_option(tmp_path, caplog):
    assert main(["manager", "serve", "--nodename", "n", "--dbfile", str(tmp_path / "m.db"), "--gpu-backend", "simulated",
                 "--simulated-gpus", "2xT4", "--pods-file", str(tmp_path / "p.json")]) == 2
    assert "'2xT4' is not a card spec" in caplog.text


def test_a_device_plugin_manager_reading_the_api_refuses_to_start_without_the_record_verify_key(tmp_path, caplog):
    """Without the extender's public key it would have to believe records a tenant wrote."""
    assert main(["manager", "serve", "--nodename", "n", "--dbfile", str(tmp_path / "m.db"), "--gpu-backend", "simulated",
                 "--simulated-gpus", "1xT4-16G", "--kubeconfig", str(tmp_path / "none")]) == 2
    assert "--record-verify-key is required" in caplog.text
    (tmp_path / "bad.pub").write_text("not a key")
    assert main(["manager", "serve", "--nodename", "n", "--dbfile", str(tmp_path / "m.db"), "--gpu-backend", "simulated",
                 "--simulated-gpus", "1xT4-16G", "--kubeconfig", str(tmp_path / "none"),
                 "--record-verify-key", str(tmp_path / "bad.pub")]) == 2
    assert "bad.pub: not a PEM public key" in caplog.text


HAS_GPU = shutil.which("nvidia-smi") is not None


@pytest.mark.skipif(HAS_GPU, reason="this host has an NVIDIA driver")
def test_nvml_without_a_driver_is_a_clear_error_not_a_fallback():
    with pytest.raises(BackendError, match="NVML init failed: .*use --gpu-backend simulated only on purpose"):
        open_backend("nvml", None, "n")


@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU and driver")
def test_nvml_discovers_the_real_cards_and_samples_them():
    import subprocess

    smi = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()
    backend = open_backend("nvml", None, "n")
    try:
        cards = backend.cards()
        assert len(cards) == len(smi)
        for card, line in zip(cards, smi):
            index, uuid, name, mem = (x.strip() for x in line.split(","))
            assert (card.index, card.uuid, card.model) == (int(index), uuid, name)
            assert abs(card.memory_mib - int(mem)) <= 1
            assert card.healthy
        usage = backend.sample()
        assert [u.index for u in usage] == [c.index for c in cards]
        assert all(0 <= u.util_pct <= 100 and 0 <= u.memory_used_mib <= c.memory_mib for u, c in zip(usage, cards))
        assert backend.wait_health_events(0.5) == []
    finally:
        backend.close()
