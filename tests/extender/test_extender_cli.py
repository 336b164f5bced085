"""`qgpu extender serve` / `qgpu webhook serve`: flags are checked before anything starts."""

from __future__ import annotations

import pytest

from qgpu_runtime.cli import main
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.model.requests import parse_pod
from qgpu_runtime.placement.policies import make_policy
from tests.extender.test_kube_cache import node, pod
from tests.recordkeys import VERIFIER, write_keys


@pytest.mark.parametrize("argv, message", [
    (["extender", "serve", "--port", "0", "--insecure-plain-http", "--address", "::1"], "--port 0: must be within 1..65535"),
    (["extender", "serve", "--tls-cert-file", "x.crt"], "--tls-private-key-file, --client-ca-file missing"),
    (["extender", "serve"], "--tls-cert-file, --tls-private-key-file, --client-ca-file missing"),
    (["extender", "serve", "--tls-cert-file", "a", "--tls-key-file", "b"], "--client-ca-file missing"),
    # plain HTTP only when asked for, and only on loopback
    (["extender", "serve", "--insecure-plain-http"], "--address 0.0.0.0 with --insecure-plain-http: plain HTTP is "
                                                     "served only on a loopback address"),
    (["extender", "serve", "--insecure-plain-http", "--address", "10.0.0.5"], "--address 10.0.0.5"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1", "--client-ca-file", "ca.crt"],
     "--insecure-plain-http and --client-ca-file: choose HTTPS or plain HTTP"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1", "--max-holds", "0"],
     "--max-holds 0: must be >= 1"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1", "--assume-timeout", "0"],
     "--assume-timeout 0.0: must be > 0 seconds"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1", "--group-timeout", "0"],
     r"--group-timeout 0.0: must be > 0 and <= 600 seconds"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1", "--group-timeout", "601"],
     r"--group-timeout 601.0: must be > 0 and <= 600 seconds"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1", "--group-settle", "-1"],
     r"--group-settle -1.0: must be >= 0, <= 60 and below --group-timeout \(60\) seconds"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1", "--group-timeout", "10", "--group-settle", "10"],
     r"--group-settle 10.0: must be >= 0, <= 60 and below --group-timeout \(10\) seconds"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1", "--evict-period", "0"],
     r"--evict-period 0.0: must be from 0.1 to 60 seconds"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1", "--evict-period", "nan"],
     r"--evict-period nan: must be from 0.1 to 60 seconds"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1"],
     "--record-signing-key missing: the extender signs every allocation record"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1", "--record-signing-key", "/nonexistent/k"],
     "--record-signing-key /nonexistent/k: cannot read it"),
    (["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1", "--largest-card-memory-mib", "1048577"],
     r"^qgpu extender serve: --largest-card-memory-mib 1048577: must be within 1024\.\.1048576 \(MiB, a card of 1 GiB to 1 TiB\)$"),
    (["webhook", "serve", "--port", "70000", "--tls-cert-file", "a", "--tls-private-key-file", "b"], "--port 70000"),
])
def test_bad_flags_are_refused_with_the_rule(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_unknown_priority_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["extender", "serve", "--priority", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err


def test_every_priority_the_cli_offers_places_and_scores():
    for policy in ("binpack", "spread", "frag"):
        c = AllocationCache(make_policy(policy), policy, verifier=VERIFIER)
        c.replace_nodes([node("a"), node("b")])
        c.replace_pods([])
        p = pod("p")
        assert c.filter(p, parse_pod(p), ["a", "b"], now_ns=1).passed == ["a", "b"]
        scores = c.prioritize(p, parse_pod(p), ["a", "b"])
        assert set(scores) == {"a", "b"} and all(0 <= s <= 10 for s in scores.values()), policy


def test_best_filter_result_answers_only_the_held_node_and_keeps_reasons():
    import json

    from qgpu_runtime.extender.app import ExtenderApp
    from qgpu_runtime.model.requests import DEFAULT_LIMITS

    c = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    c.replace_nodes([node("a"), node("b"), node("tiny", n_cards=1, memory_mib=2048)])
    p = pod("p", core=30, memory=4)
    c.replace_pods([p])  # the watch delivered it: the extender trusts its cache, not the body
    app = ExtenderApp(c, None, DEFAULT_LIMITS, filter_result="best")
    body = json.dumps({"Pod": p, "NodeNames": ["a", "b", "tiny"]}).encode()
    status, doc = app.handle("filter", body)
    assert status == 200 and doc["NodeNames"] == [c.booking("ns/p").node]
    assert set(doc["FailedAndUnresolvableNodes"]) == {"tiny"}
    with pytest.raises(ValueError, match="filter_result='some'"):
        ExtenderApp(c, None, DEFAULT_LIMITS, filter_result="some")


def serve_args(tmp_path, *flags: str):
    """`qgpu extender serve`'s parsed arguments with ``flags``, an unreachable apiserver, a signing
    key of its own and any free port."""
    import argparse

    from qgpu_runtime.extender import cli as extender_cli

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n")
    parser = argparse.ArgumentParser()
    extender_cli.add_arguments(parser)
    private_key, _ = write_keys(kubeconfig.parent / "keys")
    args = parser.parse_args(["serve", "--address", "127.0.0.1", "--port", "1", "--kubeconfig", str(kubeconfig),
                              *flags, "--record-signing-key", str(private_key)])
    args.port = 0  # any free port
    return args


def served_extender(tmp_path, flags: tuple[str, ...] = ("--insecure-plain-http",)):
    """The extender's HTTP server exactly as `qgpu extender serve` wires it (its apiserver unreachable);
    ``flags``: its transport flags (plain HTTP on loopback by default)."""
    from qgpu_runtime.extender import cli as extender_cli

    server, _, _ = extender_cli.build(serve_args(tmp_path, *flags))
    server.start()
    return server


@pytest.mark.parametrize("flags, largest", [((), 80 * 1024), (("--largest-card-memory-mib", "143771"), 143771)])
def test_the_largest_card_flag_reaches_every_parser_of_the_extender(tmp_path, flags, largest):
    """The extender parses what the webhook admitted with the same largest card: its verbs, its
    cache (filter, bookings), the trust check of a pod's body and the DRA view."""
    from qgpu_runtime.extender import cli as extender_cli

    server, app, _ = extender_cli.build(serve_args(tmp_path, "--insecure-plain-http", "--dra-prioritize", *flags))
    server.start()
    server.stop()
    assert app.limits.max_card_memory_mib == largest
    assert app.limits == app.cache.limits == app.pods.limits == app.dra.limits


def test_a_bind_body_larger_than_any_binding_is_refused_before_it_is_read(tmp_path):
    """A bind carries one pod's name, namespace, UID and node: 64 KiB is far above it, and a client
    announcing more gets 413 without the server reading (or buffering) the body."""
    import http.client

    from qgpu_runtime.extender.cli import BIND_BODY_LIMIT

    server = served_extender(tmp_path)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.putrequest("POST", "/bind")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(BIND_BODY_LIMIT + 1))
        conn.endheaders()
        assert conn.getresponse().status == 413
        conn.close()
    finally:
        server.stop()


def test_served_extender_counts_accepted_connections(tmp_path):
    """kube-scheduler keeps two idle connections per extender; the counter shows when concurrent
    binds make it open (and handshake) more. Keep-alive calls on one connection count once."""
    import http.client

    server = served_extender(tmp_path)
    try:
        def metric(conn: http.client.HTTPConnection) -> float:
            conn.request("GET", "/metrics")
            lines = conn.getresponse().read().decode().splitlines()
            return float(next(line.split()[1] for line in lines if line.startswith("qgpu_extender_connections_total ")))

        first = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        assert metric(first) == 1.0
        assert metric(first) == 1.0  # same keep-alive connection
        second = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        assert metric(second) == 2.0
        first.close()
        second.close()
    finally:
        server.stop()


@pytest.mark.parametrize("http2", ["on", "off"])
def test_served_extender_offers_http2_unless_told_not_to_and_counts_those_connections(tmp_path, http2):
    from tests.extender.h2client import Client
    from tests.k8s.pki import CertificateAuthority

    ca = CertificateAuthority(tmp_path / "pki")
    serving = ca.issue("extender", "extender", server=True, hosts=("127.0.0.1",))
    scheduler = ca.issue("scheduler", "system:kube-scheduler", client=True)
    server = served_extender(tmp_path, ("--tls-cert-file", str(serving.cert), "--tls-private-key-file", str(serving.key),
                                        "--client-ca-file", str(ca.cert_path), "--http2", http2))
    try:
        client = Client(server.port, ca.cert_path, (scheduler.cert, scheduler.key), alpn=("h2", "http/1.1"))
        if http2 == "off":
            assert client.protocol is None  # the server offers no ALPN: the client speaks HTTP/1.1
            client.close()
            return
        assert client.protocol == "h2"
        status, page = client.answer(client.send("GET", "/metrics"))
        client.close()
        assert status == 200
        assert "qgpu_extender_http2_connections_total 1.0" in page.decode()
    finally:
        server.stop()


@pytest.mark.parametrize("flags, mode", [
    ([], "auto"),
    (["--node-commitments"], "always"),  # the earlier spelling of "on"
    (["--node-commitments=auto"], "auto"),
    (["--node-commitments", "off"], "off"),
    (["--no-node-commitments"], "off"),  # the earlier spelling of "off"
])
def test_node_commitments_modes_and_their_earlier_spellings(flags, mode):
    import argparse

    from qgpu_runtime.extender.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["serve", *flags]).node_commitments == mode


def test_an_unknown_node_commitments_mode_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["extender", "serve", "--node-commitments=sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err
