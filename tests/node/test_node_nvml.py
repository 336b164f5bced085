"""The NVML edge (qgpu_runtime/gpu): loading, discovery, health events, the one per-process
sample, and the node's metrics and isolation loop reading the same sample. A fake pynvml module
(fakenvml.py) stands in for the driver; tests/node/test_node_gpu_backends.py covers a real card."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from fakenvml import MIB, FakeCard, FakeNvml, two_cards
from podfactory import pod, qgpu
from simnode import FakeProc, cgroupfs, cid_of

from qgpu_runtime.gpu import BackendError, CardInfo, HealthEvent
from qgpu_runtime.gpu.nvml import NvmlBackend
from qgpu_runtime.gpu.nvml_lib import NvmlUnavailable, cuda_driver_version, list_cards, load_nvml
from qgpu_runtime.gpu.nvml_processes import ProcessSampler, SmSample
from qgpu_runtime.isolation.nvml_sampler import NvmlSampler
from qgpu_runtime.node.containers import ContainerResolver
from qgpu_runtime.node.enforcer import default_backend
from qgpu_runtime.node.metrics import build_snapshot
from qgpu_runtime.node.store import Share

PACKAGE = Path(__file__).parents[2] / "qgpu_runtime"


def test_only_the_gpu_edge_imports_pynvml():
    importing = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                       if re.search(r"^\s*(import pynvml|from pynvml\b)", p.read_text(), re.MULTILINE))
    assert importing == ["gpu/nvml_lib.py"]


def test_a_broken_install_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(NvmlUnavailable, match=r"import pynvml \(package nvidia-ml-py\)") as err:
        load_nvml()
    assert isinstance(err.value, BackendError)  # the node's start-up catches one error type


def test_cards_are_discovered_as_card_info_with_their_minor_numbers():
    nv = two_cards()
    assert list_cards(nv) == (CardInfo(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559, 0),
                              CardInfo(1, "GPU-bbbb", "NVIDIA H100 80GB HBM3", 81559, 3))
    assert cuda_driver_version(nv) == 13000


def test_discovery_failure_names_the_card_and_shuts_nvml_down():
    nv = two_cards()
    nv.cards[1].fail = "nvmlDeviceGetMinorNumber"
    with pytest.raises(NvmlUnavailable, match=r"NVML discovery failed at card 1: nvmlDeviceGetMinorNumber: GPU is lost"):
        NvmlBackend(nv=nv)
    assert nv.shut_down


def test_a_host_without_cards_is_an_error():
    nv = FakeNvml([])
    with pytest.raises(BackendError, match="NVML reports no GPUs on this host"):
        NvmlBackend(nv=nv)
    assert nv.shut_down


def test_health_events_skip_application_xids():
    nv = two_cards()
    backend = NvmlBackend(nv=nv)
    nv.xid(1, 13)  # graphics engine exception: the application's fault
    nv.xid(1, 79)  # fallen off the bus
    assert backend.wait_health_events(0.01) == []
    assert backend.wait_health_events(0.01) == [HealthEvent(1, "XID 79")]
    assert backend.wait_health_events(0.01) == []  # timeout
    backend.close()
    assert nv.shut_down


def test_a_card_returns_once_it_answers_and_needs_no_reset_checked_after_a_quiet_period():
    nv = two_cards()
    now = [100.0]
    backend = NvmlBackend(nv=nv, recheck_s=30.0, clock=lambda: now[0])
    nv.xid(1, 48)  # double-bit ECC: page retirement pending until the card is reset
    nv.cards[1].retirement_pending = True
    assert backend.wait_health_events(0.01) == [HealthEvent(1, "XID 48")]
    now[0] += 29.0
    assert backend.wait_health_events(0.01) == []  # not checked before the quiet period
    now[0] += 1.0
    assert backend.wait_health_events(0.01) == []  # checked: still pending, out for another period
    nv.cards[1].retirement_pending = False  # reset
    nv.cards[1].fail = "nvmlDeviceGetMemoryInfo"  # ... but fallen off the bus
    now[0] += 30.0
    assert backend.wait_health_events(0.01) == []
    nv.cards[1].fail = None
    nv.cards[1].remap_pending = True
    now[0] += 30.0
    assert backend.wait_health_events(0.01) == []
    nv.cards[1].remap_pending = None  # a card without row remapping: that check does not apply
    nv.cards[1].retirement_pending = None
    now[0] += 30.0
    [back] = backend.wait_health_events(0.01)
    assert (back.card_index, back.healthy) == (1, True) and "answers NVML again" in back.reason
    now[0] += 300.0
    assert backend.wait_health_events(0.01) == []  # reported once
    backend.close()


def test_each_reader_sees_every_driver_sample_once_and_nvml_is_asked_from_the_newest():
    nv = FakeNvml([FakeCard("GPU-aaaa", "T4", 15360, 0, procs=[(101, 1024 * MIB)], samples=[(101, 1000, 30)])])
    sampler = ProcessSampler(nv, [0])
    fast, slow = sampler.reader(), sampler.reader()
    [first] = fast.card(0)
    assert (first.pid, first.memory_mib, first.sm, first.sm_util_pct) == (101, 1024, (SmSample(1000, 30),), 30)
    [again] = fast.card(0)
    assert (again.sm, again.sm_util_pct, again.memory_mib) == ((), 0, 1024)  # nothing new: memory only
    nv.cards[0].samples.append((101, 2000, 50))
    assert fast.card(0)[0].sm == (SmSample(2000, 50),)
    # the other reader was not robbed by the first one's polls
    [seen] = slow.card(0)
    assert (seen.sm, seen.sm_util_pct) == ((SmSample(1000, 30), SmSample(2000, 50)), 50)
    # asked from a second behind the newest timestamp taken (here: from the start)
    assert [since for _, since in nv.utilization_calls] == [0, 0, 0, 0]


def test_a_sample_stamped_before_one_already_taken_is_not_lost():
    # the driver wrote pid 102's sample for a period after pid 101's newer one had been read:
    # asking only for samples newer than the newest taken would never return it
    nv = FakeNvml([FakeCard("GPU-aaaa", "T4", 15360, 0, procs=[(101, 1024 * MIB), (102, 1024 * MIB)],
                            samples=[(101, 5_000_000, 90)])])
    reader = ProcessSampler(nv, [0]).reader()
    assert {p.pid: p.sm for p in reader.card(0)} == {101: (SmSample(5_000_000, 90),), 102: ()}
    nv.cards[0].samples.append((102, 4_990_000, 80))
    assert {p.pid: p.sm for p in reader.card(0)} == {101: (), 102: (SmSample(4_990_000, 80),)}
    assert {p.pid: p.sm for p in reader.card(0)} == {101: (), 102: ()}  # each once
    assert [since for _, since in nv.utilization_calls] == [0, 4_000_000, 4_000_000]


def test_processes_with_a_sample_or_a_context_are_listed_and_contexts_summed():
    nv = FakeNvml([FakeCard("GPU-aaaa", "T4", 15360, 0, procs=[(101, 512 * MIB), (101, 256 * MIB), (102, None)],
                            samples=[(103, 1000, 5)])])
    got = {p.pid: (p.memory_mib, p.sm_util_pct) for p in ProcessSampler(nv, [0]).reader().card(0)}
    assert got == {101: (768, 0), 102: (0, 0), 103: (0, 5)}


def test_a_failing_call_names_the_card_and_the_call():
    nv = two_cards()
    nv.cards[1].fail = "nvmlDeviceGetProcessUtilization"
    reader = ProcessSampler(nv, [0, 1]).reader()
    assert reader.card(0) == ()
    with pytest.raises(BackendError, match=r"card 1: nvmlDeviceGetProcessUtilization: .*GPU is lost"):
        reader.card(1)


def test_metrics_skip_a_card_whose_sample_fails(caplog):
    nv = two_cards()
    backend = NvmlBackend(nv=nv)
    nv.cards[0].fail = "nvmlDeviceGetComputeRunningProcesses"
    assert [u.index for u in backend.sample()] == [1]
    assert "card 0: sampling failed: card 0: nvmlDeviceGetComputeRunningProcesses" in caplog.text


KEY = "default/infer/main"


def node_with_one_container(tmp_path):
    """Card 1 of a fake NVML runs two processes of one qgpu container and one host process."""
    nv = two_cards()
    cid = cid_of(1)
    p = pod("infer", "n", [("main", qgpu(50, 4), [(1, "GPU-bbbb", 500, 4096)])], container_ids={"main": cid})
    uid = p["metadata"]["uid"]
    proc = FakeProc(tmp_path / "proc")
    proc.add(101, cgroupfs(uid, cid), pgid=101)
    proc.add(102, cgroupfs(uid, cid), pgid=101)
    proc.add(999, "0::/user.slice/session-1.scope\n", pgid=999)
    shares = [Share(uid, "default", "infer", "main", 1, "GPU-bbbb", 500, 4096, "normal", 1)]
    backend = NvmlBackend(nv=nv, proc_root=proc.root)
    resolver = ContainerResolver(proc.root)
    workloads = resolver.update([p], shares)
    isolation, _ = default_backend(backend)(resolver)  # as `qgpu manager serve` wires it
    return nv, backend, isolation, workloads, shares, p


def test_metrics_and_isolation_read_the_same_per_process_sample(tmp_path):
    nv, backend, isolation, workloads, shares, p = node_with_one_container(tmp_path)
    assert isinstance(isolation, NvmlSampler)
    card = nv.cards[1]

    def metrics_used() -> tuple[int, int]:
        snap = build_snapshot("n", backend.cards(), {}, backend.sample(), shares, [p])
        [row] = snap.containers
        return row.used[1]

    def isolation_used() -> tuple[float, int]:
        usage = isolation.sample(workloads, 0.05, frozenset())[1][KEY]
        return usage.used_milli, usage.memory_mib

    card.procs = [(101, 1024 * MIB), (102, 512 * MIB), (999, 2048 * MIB)]
    card.samples = [(101, 1_000_000, 30), (102, 1_000_000, 20), (999, 1_000_000, 40)]
    milli, mib = isolation_used()  # the isolation tick polls first ...
    assert metrics_used() == (50, 1536) == (round(milli / 10), mib)  # ... and the metrics see its figures

    # one tick later (50 ms of driver time): the metrics poll first, isolation still gets the samples
    card.procs[0] = (101, 2048 * MIB)
    card.samples += [(101, 1_050_000, 60), (102, 1_050_000, 10)]
    used = metrics_used()
    milli, mib = isolation_used()
    assert used == (70, 2560)
    assert (milli, mib) == (pytest.approx(700), 2560)
    # one stream of driver timestamps for both consumers (card 1: isolation, metrics, metrics, isolation)
    assert [since for index, since in nv.utilization_calls if index == 1] == [0, 0, 0, 50_000]
