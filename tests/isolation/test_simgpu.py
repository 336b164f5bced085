import pytest

from qgpu_runtime.isolation.simgpu import SimulatedGPU, SimulatedOutOfMemory, fair_split


def test_fair_split_gives_small_demands_what_they_want_and_splits_the_rest():
    assert fair_split({1: 100, 2: 1000, 3: 1000}) == {1: 100, 2: 450, 3: 450}


def test_fair_split_of_light_demands_leaves_the_card_partly_idle():
    assert sum(fair_split({1: 200, 2: 300}).values()) == 500


def test_busy_processes_time_share_the_card_equally():
    gpu = SimulatedGPU(0, "u", "SIM", 1000)
    for pid in (1, 2, 3, 4):
        gpu.spawn(pid, 1000)
    gpu.advance(2.0)
    assert {s.used_milli for s in gpu.sample(2.0).values()} == {250}


def test_suspended_process_gets_nothing_and_its_share_goes_to_the_others():
    gpu = SimulatedGPU(0, "u", "SIM", 1000)
    gpu.spawn(1, 1000)
    gpu.spawn(2, 1000)
    gpu.suspend(1)
    gpu.advance(1.0)
    seen = gpu.sample(1.0)
    assert seen[1].used_milli == 0 and seen[2].used_milli == 1000


def test_queued_work_keeps_running_for_the_drain_time_after_suspension():
    gpu = SimulatedGPU(0, "u", "SIM", 1000, drain_s=0.25)
    gpu.spawn(1, 1000)
    gpu.suspend(1)
    gpu.advance(1.0)
    assert gpu.sample(1.0)[1].used_milli == pytest.approx(250)


def test_allocation_past_the_card_memory_fails_like_cudamalloc():
    gpu = SimulatedGPU(0, "u", "SIM", 1000)
    gpu.spawn(1, 0, memory_mib=800)
    gpu.spawn(2, 0)
    with pytest.raises(SimulatedOutOfMemory, match="200 MiB free"):
        gpu.allocate(2, 300)


def test_pinned_limit_refuses_allocation_past_the_process_limit():
    gpu = SimulatedGPU(0, "u", "SIM", 10000)
    gpu.spawn(1, 0, memory_mib=400, memory_limit_mib=500)
    with pytest.raises(SimulatedOutOfMemory, match="pinned limit of 500 MiB"):
        gpu.allocate(1, 200)
