"""The simulated host's usage file (`--simulated-usage`): a malformed entry gets the defaults and
a warning; it never stops the manager's loop (the file may sit where others can write it)."""

from __future__ import annotations

import json
import logging

import pytest

from qgpu_runtime.standalone.simhost import SimulatedHost
from qgpu_runtime.standalone.store import JobRecord, JobShare, StoredCard


class NoSignals:
    def hold(self, key: str) -> None: ...

    def resume(self, key: str) -> None: ...


def job(key: str, pgid: int) -> JobRecord:
    return JobRecord(key, key, "normal", 100, 1024, (JobShare(0, "GPU-0", 100, 1024),), "true", 0.0, 1, 1, pgid, 1)


@pytest.mark.parametrize("entry", [[1], "busy", {"demand_milli": "x"}, {"demand_milli": 1e999}, {"demand_milli": -5},
                                   {"demand_milli": 2000}, {"memory_mib": 1.5}, {"memory_mib": 1 << 40},
                                   {"demand_milli": True}, {"memory_mib": None}], ids=repr)
def test_a_malformed_entry_gets_the_defaults_and_a_warning(tmp_path, entry, caplog):
    usage = tmp_path / "usage.json"
    usage.write_text(json.dumps({"bad": entry, "good": {"demand_milli": 300, "memory_mib": 1500}}).replace("Infinity", "1e999"))
    host = SimulatedHost([StoredCard(0, "GPU-0", "Tesla T4", 16384)], NoSignals(), str(usage))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="qgpu.standalone.simhost"):
        host.sync([job("bad", 4001), job("good", 4002)])
    procs = {pid: p for pid, p in host.sim.gpus[0].processes.items()}
    by_job = {key: procs[pid] for key, pids in host.sim.pids.items() for pid in pids.values()}
    assert (by_job["bad"].demand_milli, by_job["bad"].memory_mib) == (1000.0, 0)
    assert (by_job["good"].demand_milli, by_job["good"].memory_mib) == (300.0, 1500)
    assert any("entry of job bad" in r.getMessage() for r in caplog.records), caplog.text
