"""Client-side CPU of one API call: the generated ``kubernetes`` method against the thin client
(qgpu_runtime/kube/hotcalls.py), the binder's two per-pod calls (issue 23 §2).

A local plain-HTTP server answers every request at once with a small Lease, in threads of its own,
so the calling thread's CPU time (``time.thread_time``) is the client's alone: argument checks,
models, serialisation, headers, urllib3, the answer's decoding. The arms alternate, ``--rounds``
times ``--calls`` calls each. Reported: ms of CPU per call, per round.

Run: .venv/bin/python bench/kube_hotcalls.py [--calls 400 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kubernetes import client  # noqa: E402

from bench.answering_server import AnsweringServer  # noqa: E402
from qgpu_runtime.kube.hotcalls import HotCalls  # noqa: E402

ANSWER = json.dumps({"kind": "Lease", "apiVersion": "coordination.k8s.io/v1",
                     "metadata": {"name": "x", "namespace": "n", "resourceVersion": "12"}, "spec": {}}).encode()
NOTE = "x" * 300  # an allocation record's size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be >= 1")
    server = AnsweringServer(ANSWER).start()
    configuration = client.Configuration()
    configuration.host = server.url
    configuration.api_key = {"authorization": "Bearer token"}
    api_client = client.ApiClient(configuration)
    core, coordination, hot = client.CoreV1Api(api_client), client.CoordinationV1Api(api_client), HotCalls(api_client)
    timeout = (3.0, 10.0)
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": "x", "namespace": "n", "resourceVersion": "1", "annotations": {"a": NOTE}}, "spec": {}}
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p", "namespace": "ns", "uid": "u", "annotations": {"a": NOTE}},
               "target": {"apiVersion": "v1", "kind": "Node", "name": "n"}}

    def generated_binding() -> None:  # as podapi.py made it before
        body = client.V1Binding(metadata=client.V1ObjectMeta(name="p", namespace="ns", uid="u", annotations={"a": NOTE}),
                                target=client.V1ObjectReference(api_version="v1", kind="Node", name="n"))
        response = core.create_namespaced_pod_binding("p", "ns", body, _preload_content=False, _request_timeout=timeout)
        response.read()
        response.release_conn()

    def generated_lease_put() -> None:  # as kube/leasedoc.py makes it for the webhook's ledger
        json.loads(coordination.replace_namespaced_lease("x", "n", lease, _preload_content=False, _request_timeout=timeout).data)

    arms = {"binding_generated": generated_binding,
            "binding_thin": lambda: hot.create_binding("ns", "p", binding, timeout),
            "lease_put_generated": generated_lease_put,
            "lease_put_thin": lambda: hot.replace_lease("n", "x", lease, timeout)}
    for call in arms.values():
        call()
    result: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, call in arms.items():
            started = time.thread_time()
            for _ in range(args.calls):
                call()
            result[name].append(round((time.thread_time() - started) / args.calls * 1000, 3))
    server.shutdown()
    print(json.dumps({"calls": args.calls, "cpu_ms_per_call": result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
