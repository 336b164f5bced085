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
    --tls-private-key-file K --client-ca-file CA [--server granian]

``--server granian`` (`bench/extender_bench.py --compare-floor`) answers the same verbs from the
same handler behind granian, a Rust HTTP/1.1 and HTTP/2 server (hyper, rustls), embedded in this
process (its asyncio interface: the process's CPU is all of it): what the floor would be with the HTTP/2
framing, TLS and client-certificate check out of Python. Every connection must present a
certificate the client CA signed (the benchmark's probes do), TLS 1.3 only. An experiment, not a
server qgpu ships: none of qgpu_runtime.serving's bounds for hostile callers are there.
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


def serve_granian(app: NullExtender, args: argparse.Namespace) -> None:
    """``app`` as an RSGI application in granian's embedded server (this process, one asyncio
    loop; HTTP and TLS on granian's Rust threads). filter and prioritize answer on the loop; bind,
    which waits for the apiserver, on a thread pool."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    from qgpu_runtime.serving import encode_json

    pool = ThreadPoolExecutor(8, thread_name_prefix="bind")
    json_headers = [("content-type", "application/json")]

    async def rsgi(scope: Any, proto: Any) -> None:
        path = scope.path
        if scope.method == "GET" and path in ("/healthz", "/readyz"):
            proto.response_bytes(200, [("content-type", "text/plain")], b"ok")
            return
        if scope.method != "POST":
            proto.response_bytes(405, [], b"")
            return
        body = await proto()
        verb = path.lstrip("/")
        if verb == "bind":
            code, doc = await asyncio.get_running_loop().run_in_executor(pool, app.handle, verb, body)
        else:
            code, doc = app.handle(verb, body)
        proto.response_bytes(code, json_headers, encode_json(doc))

    server = Server(rsgi, address=args.address, port=args.port, interface=Interfaces.RSGI,
                    http=HTTPModes.auto if args.http2 == "on" else HTTPModes.http1, websockets=False,
                    ssl_cert=Path(args.tls_cert_file), ssl_key=Path(args.tls_private_key_file),
                    ssl_ca=Path(args.client_ca_file), ssl_client_verify=True, log_access=False)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, server.stop)
        await server.serve()

    asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.null_extender", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--tls-cert-file", required=True)
    parser.add_argument("--tls-private-key-file", required=True)
    parser.add_argument("--client-ca-file", required=True)
    parser.add_argument("--http2", choices=("on", "off"), default="on", help="as `qgpu extender serve --http2`")
    parser.add_argument("--server", choices=("qgpu", "granian"), default="qgpu",
                        help="qgpu_runtime.serving (as the extender) or granian (an experiment)")
    args = parser.parse_args(argv)
    app = NullExtender(client.CoreV1Api(api_client(args.kubeconfig)))
    if args.server == "granian":
        serve_granian(app, args)
        return 0
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
