"""Issue 22 §3: the environment HAMi's and KAI's images read, built from the record's dialect."""

from __future__ import annotations

from qgpu_runtime.contract.environment import container_environment
from qgpu_runtime.contract.record import AllocationRecord, CardShare, ContainerDialect, ContainerPlacement, parse_record
from qgpu_runtime.model import AppClass

SHARES = (CardShare(0, "GPU-a", 300, 3000), CardShare(2, "GPU-c", 300, 3000))


def test_hami_limits_per_visible_card_and_the_compute_percent():
    env = container_environment(SHARES, "normal", "fair", None, ContainerDialect("hami"))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-c"
    assert (env["CUDA_DEVICE_MEMORY_LIMIT_0"], env["CUDA_DEVICE_MEMORY_LIMIT_1"], env["CUDA_DEVICE_SM_LIMIT"]) == ("3000m", "3000m", "30")


def test_kai_portion_only_for_a_fraction():
    assert container_environment(SHARES[:1], "normal", "fair", None, ContainerDialect("kai", 50))["GPU_PORTION"] == "0.5"
    assert "GPU_PORTION" not in container_environment(SHARES[:1], "normal", "fair", None, ContainerDialect("kai"))


def test_other_dialects_and_old_records_get_no_peer_variables():
    for asked in (None, ContainerDialect("qgpu"), ContainerDialect("nvidia"), ContainerDialect("t9k", 30)):
        env = container_environment(SHARES, "normal", "fair", None, asked)
        assert not any(k.startswith(("CUDA_DEVICE_", "GPU_PORTION")) for k in env), asked


def test_the_record_carries_the_new_dialects_both_ways():
    record = AllocationRecord("n", "binpack", AppClass.NORMAL, "t", (
        ContainerPlacement("h", SHARES, dialect=ContainerDialect("hami")),
        ContainerPlacement("k", SHARES[:1], dialect=ContainerDialect("kai", 34))))
    back = parse_record(record.to_json())
    assert [c.dialect for c in back.containers] == [ContainerDialect("hami"), ContainerDialect("kai", 34)]
