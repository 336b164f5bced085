"""kill -9 of a real manager process at random moments of admission, then a consistency check."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from podfactory import pod, qgpu, write_pods
from testkubelet import TestKubelet

from qgpu_runtime.gpu.simulated import build_cards, parse_spec
from qgpu_runtime.node.store import Store

NODE = "crash-node"
CORE = "tke.cloud.tencent.com/qgpu-core"
MEM = "tke.cloud.tencent.com/qgpu-memory"
SPEC = "8xV100-32G"
REPO = Path(__file__).resolve().parents[2]  # run this checkout's package, whatever pytest's cwd


def start_manager(root: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "qgpu_runtime.cli", "manager", "serve", "--nodename", NODE,
           "--dbfile", str(root / "meta.db"), "--gpu-backend", "simulated", "--simulated-gpus", SPEC,
           "--pods-file", str(root / "pods.json"), "--device-plugin-dir", str(root / "dp"),
           "--pod-resources-socket", str(root / "pr" / "kubelet.sock"), "--state-dir", str(root / "state"),
           "--resources", f"{CORE},{MEM}", "--metrics-port", "-1", "--log-level", "WARNING"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(root / "manager.log", "a"))


def registered(kubelet: TestKubelet, before: int, proc: subprocess.Popen, root: Path) -> None:
    """The manager started as ``proc`` registered both resources with devices; else an
    AssertionError with whether it is still running and its log's end."""
    try:
        kubelet.wait_for(lambda: len(kubelet.registrations) >= before + 2
                         and all(p.devices for p in kubelet.plugins.values()), timeout=30)
    except TimeoutError as exc:
        state = "running" if proc.poll() is None else f"exited with {proc.returncode}"
        raise AssertionError(f"{exc}; the manager is {state}; its log:\n"
                             + (root / "manager.log").read_text(errors="replace")[-8000:]) from None


def test_store_stays_consistent_through_kill_9_mid_allocate(short_tmp):
    root = short_tmp
    rng = random.Random(7)
    cards = build_cards(parse_spec(SPEC), NODE)
    pods = [pod(f"p{i:02d}", NODE, [("main", qgpu(10, 1), [(i % 8, cards[i % 8].uuid, 100, 1024)])], bind_time=i + 1)
            for i in range(48)]
    write_pods(root / "pods.json", pods)
    kubelet = TestKubelet(root / "dp", root / "pr" / "kubelet.sock")
    kubelet.start()
    queue = list(pods)
    failed: set[str] = set()

    def admit_until_killed(stop: threading.Event) -> None:
        while queue and not stop.is_set():
            p = queue[0]
            try:
                kubelet.admit(p)
            except (grpc.RpcError, KeyError, RuntimeError):
                # kubelet fails the pod's admission (UnexpectedAdmissionError): it ends in phase Failed
                failed.add(p["metadata"]["name"])
                kubelet.forget("default", p["metadata"]["name"])
                queue.pop(0)
                return
            queue.pop(0)

    kills = 0
    try:
        for _ in range(10):
            before = len(kubelet.registrations)
            proc = start_manager(root)
            registered(kubelet, before, proc, root)
            stop = threading.Event()
            worker = threading.Thread(target=admit_until_killed, args=(stop,))
            worker.start()
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
            stop.set()
            worker.join(timeout=30)
            # kubelet marks failed admissions Failed; the apiserver keeps the pod until its owner deletes it
            current = json.loads((root / "pods.json").read_text())["items"]
            for p in current:
                if p["metadata"]["name"] in failed:
                    p["status"]["phase"] = "Failed"
            write_pods(root / "pods.json", current)
            kubelet.restart()  # also proves the next manager re-registers with a new kubelet socket

        # Recovery: a fresh manager reconciles and then admits the rest normally.
        before = len(kubelet.registrations)
        proc = start_manager(root)
        registered(kubelet, before, proc, root)
        for p in list(queue):
            kubelet.admit(p)
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=30) == 0
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # the manager dumps its threads' stacks into manager.log
            time.sleep(1)
            proc.kill()
            raise AssertionError("manager ignored SIGTERM for 30 s; its log and stacks:\n"
                                 + (root / "manager.log").read_text()[-8000:]) from None
    finally:
        kubelet.stop()

    assert kills == 10 and failed, "the kills should have interrupted some admissions"
    store = Store(root / "meta.db")
    try:
        assert store.integrity() == "ok"
        grants = store.grants()
        by_pod = {(g.pod, g.container, g.resource): set(g.device_ids) for g in grants}
        held = {(name, c, r): set(ids) for (_, name), cs in kubelet.held.items() for c, rs in cs.items() for r, ids in rs.items()}
        assert by_pod == held, "store and kubelet disagree about who holds which devices"
        assert not {g.pod for g in grants} & failed
        shares = store.shares()
        assert {(s.workload, s.container) for s in shares} == {(g.pod, g.container) for g in grants}
        record_card = {p["metadata"]["name"]: int(p["metadata"]["name"][1:]) % 8 for p in pods}
        assert all(s.card_index == record_card[s.workload] and s.core_milli == 100 for s in shares)
        per_card: dict[int, int] = {}
        for s in shares:
            per_card[s.card_index] = per_card.get(s.card_index, 0) + s.core_milli
        assert max(per_card.values()) <= 1000
    finally:
        store.close()
