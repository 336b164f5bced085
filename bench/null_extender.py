"""The floor of the scheduler-extender protocol (issue 14 §2): an extender that decides nothing.

It speaks the same verbs as `qgpu extender serve` in its default configuration (filter,
prioritize, bind; NodeNames form; HTTPS with client certificates; the same server stack,
qgpu_runtime.serving) and answers them at the least cost an answer can have: filter passes every
name it is sent, prioritize gives every host 0, and bind creates the Binding (what any extender
with a bindVerb must do). It keeps no cache and watches nothing.

`bench/extender_bench.py --floor` runs it beside qgpu's extender and the no-extender baseline. What
the control plane (kube-scheduler, kube-apiserver, etcd) spends with it over the baseline is what
the extender protocol itself makes them spend, whatever the extender does; what it spends itself is
the least a Python HTTPS extender pays to answer. Neither is qgpu's decision-making.

Not a product: it places pods on whatever node the scheduler ranks first, with no GPU accounting.

Run (by the benchmark): python -m bench.null_extender --port P --kubeconfig K --tls-cert-file C
    --tls-private-key-file K --client-ca-file CA
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from qgpu_runtime.extender.wire import BindingArgs, ExtenderArgs, FilterResult, WireError, encode_binding_result, encode_priorities_json
from qgpu_runtime.kube.client import api_client, drain
from qgpu_runtime.serving import JsonServer, RawJSON, Routes


class NullExtender:
    def __init__(self, api: client.CoreV1Api):
        self.api = api

    def handle(self, verb: str, body: bytes) -> tuple[int, Any]:
        try:
            if verb == "filter":
                args = ExtenderArgs.decode(body)
                return 200, FilterResult(args.names).encode(args)
            if verb == "prioritize":
                names = ExtenderArgs.decode(body).names
                return 200, RawJSON(encode_priorities_json(names, [0] * len(names)))
            if verb == "bind":
                return 200, self.bind(BindingArgs.decode(body))
        except WireError as exc:
            return 400, {"Error": str(exc)}
        return 404, {"Error": f"unknown verb {verb!r}"}

    def bind(self, args: BindingArgs) -> dict[str, Any]:
        meta = client.V1ObjectMeta(name=args.pod_name, namespace=args.pod_namespace, uid=args.pod_uid or None)
        body = client.V1Binding(metadata=meta, target=client.V1ObjectReference(api_version="v1", kind="Node", name=args.node))
        try:
            drain(self.api.create_namespaced_pod_binding(args.pod_name, args.pod_namespace, body, _preload_content=False,
                                                        _request_timeout=30))
        except ApiException as exc:
            return encode_binding_result(f"binding failed: {exc.status} {exc.reason}")
        return encode_binding_result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.null_extender", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--tls-cert-file", required=True)
    parser.add_argument("--tls-private-key-file", required=True)
    parser.add_argument("--client-ca-file", required=True)
    parser.add_argument("--http2", choices=("on", "off"), default="on", help="as `qgpu extender serve --http2`")
    args = parser.parse_args(argv)
    app = NullExtender(client.CoreV1Api(api_client(args.kubeconfig)))
    routes = Routes(post={"/": app.handle}, get={"/healthz": lambda: (200, "text/plain", b"ok"),
                                                 "/readyz": lambda: (200, "text/plain", b"ok")},
                    open_paths=frozenset({"/healthz", "/readyz"}), inline=frozenset({"/filter", "/prioritize"}))
    server = JsonServer(args.address, args.port, routes, args.tls_cert_file, args.tls_private_key_file,
                        client_ca_file=args.client_ca_file, http2=args.http2 == "on")
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.stop, daemon=True).start())
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
