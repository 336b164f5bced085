"""The serving certificate is read again when its files change (qgpu_runtime/servingcert.py): a real
TLS client on 127.0.0.1 sees the renewed certificate on its next connection, after a rename over
the file and after kubelet's swap of a Secret volume's ``..data`` symlink; a replacement that does
not load leaves the previous certificate served and is counted; the expiry gauge is the served
certificate's notAfter. The only waits are for the reload itself, under a generous deadline."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import os
import socket
import ssl
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prometheus_client import CollectorRegistry

from qgpu_runtime.serving import JsonServer, Routes, ServerLimits
from qgpu_runtime.servingcert import CertificateError, CertificateFiles, CertificateMetrics, ServingCertificate
from tests.extender.h2client import Client
from tests.polling import poll

CHECK_S = 0.05  # how often the server looks at its files here (10 s in production)
LIMITS = ServerLimits(max_connections=16, watch_interval_s=0.05)
PREFIX = "qgpu_test"
EXPIRATION = f"{PREFIX}_serving_certificate_expiration_timestamp_seconds"
NOW = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


class Ca:
    """A CA whose leaves this test chooses the key and the notAfter of."""

    def __init__(self, cn: str = "qgpu-test-ca"):
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(NOW - datetime.timedelta(hours=1)).not_valid_after(NOW + datetime.timedelta(days=30))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def leaf(self, key: ec.EllipticCurvePrivateKey, days: int, *, client: bool = False) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(_name("client" if client else "qgpu-test-server"))
                   .issuer_name(self.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(NOW - datetime.timedelta(hours=1)).not_valid_after(NOW + datetime.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client
                                                         else ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
        if not client:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                            critical=False)
        return builder.sign(self.key, hashes.SHA256())


@dataclass
class Pair:
    """A serving certificate, its key, and the files' bytes."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _pem(self.key)

    @property
    def der(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.DER)


@dataclass
class Pki:
    ca: Ca
    ca_file: Path
    client_cert: Path
    client_key: Path

    def pair(self, days: int, key: ec.EllipticCurvePrivateKey | None = None) -> Pair:
        key = key or ec.generate_private_key(ec.SECP256R1())
        return Pair(self.ca.leaf(key, days), key)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = Ca()
    ca_file = tmp_path / "trust" / "ca.crt"
    ca_file.parent.mkdir()
    ca_file.write_bytes(ca.pem)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert, client_key_file = tmp_path / "trust" / "client.crt", tmp_path / "trust" / "client.key"
    client_cert.write_bytes(ca.leaf(client_key, 5, client=True).public_bytes(serialization.Encoding.PEM))
    client_key_file.write_bytes(_pem(client_key))
    return Pki(ca, ca_file, client_cert, client_key_file)


def replace_file(path: Path, data: bytes) -> None:
    """Write beside ``path`` and rename over it: what an operator's script or `install` does."""
    part = path.with_name(path.name + ".part")
    part.write_bytes(data)
    os.replace(part, path)


class SecretVolume:
    """A Secret projected as kubelet does it: ``tls.crt`` → ``..data/tls.crt``, ``..data`` → a
    timestamped directory; an update writes a new directory and renames a new ``..data`` over the
    old one (one atomic step for every file), then deletes the old directory."""

    def __init__(self, root: Path, files: dict[str, bytes]):
        self.root = root
        root.mkdir()
        self.generation = 0
        self._current = self._write(files)
        (root / "..data").symlink_to(self._current.name)
        for name in files:
            (root / name).symlink_to(f"..data/{name}")

    def _write(self, files: dict[str, bytes]) -> Path:
        self.generation += 1
        directory = self.root / f"..2026_01_01_00_00_0{self.generation}.{os.getpid()}"
        directory.mkdir()
        for name, data in files.items():
            (directory / name).write_bytes(data)
        return directory

    def update(self, files: dict[str, bytes]) -> None:
        old, self._current = self._current, self._write(files)
        (self.root / "..data_tmp").symlink_to(self._current.name)
        os.replace(self.root / "..data_tmp", self.root / "..data")
        for child in old.iterdir():
            child.unlink()
        old.rmdir()

    def path(self, name: str) -> str:
        return str(self.root / name)


def routes() -> Routes:
    return Routes(post={"/echo": lambda rest, body: (200, {"got": len(body)})},
                  get={"/healthz": lambda: (200, "text/plain", b"ok")}, open_paths=frozenset({"/healthz"}))


@dataclass
class Served:
    server: JsonServer
    registry: CollectorRegistry
    pki: Pki

    def sample(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def failed(self) -> float | None:
        return self.sample(f"{PREFIX}_serving_certificate_reloads_total", result="failed")

    def loaded(self) -> float | None:
        return self.sample(f"{PREFIX}_serving_certificate_reloads_total", result="loaded")

    def client_context(self, *, certificate: bool = True, alpn: tuple[str, ...] = ()) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_file))
        if certificate:
            ctx.load_cert_chain(str(self.pki.client_cert), str(self.pki.client_key))
        if alpn:
            ctx.set_alpn_protocols(list(alpn))
        return ctx

    def served_der(self) -> bytes:
        """The certificate a new connection is served (a full handshake, verified against the CA)."""
        with socket.create_connection(("127.0.0.1", self.server.port), timeout=10) as raw:
            with self.client_context().wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                der = tls.getpeercert(binary_form=True)
        assert der is not None
        return der

    def connection(self, **kwargs: Any) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.server.port, timeout=10, context=self.client_context(**kwargs))


def echo(conn: http.client.HTTPSConnection) -> int:
    conn.request("POST", "/echo", body=b"{}", headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response.status


@pytest.fixture
def serve(pki: Pki) -> Iterator[Any]:
    servers: list[JsonServer] = []

    def start(cert_file: str, key_file: str, ca_file: str | None = None, http2: bool = True) -> Served:
        registry = CollectorRegistry()
        server = JsonServer("127.0.0.1", 0, routes(), cert_file, key_file, limits=LIMITS,
                            client_ca_file=ca_file or str(pki.ca_file), http2=http2,
                            certificate_metrics=CertificateMetrics.create(registry, PREFIX), certificate_check_s=CHECK_S)
        server.start()
        servers.append(server)
        return Served(server, registry, pki)

    yield start
    for server in servers:
        server.stop()


def test_a_certificate_renamed_over_the_file_reaches_new_connections_and_open_ones_keep_theirs(tmp_path, pki, serve):
    first = pki.pair(days=20)
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert_file.write_bytes(first.cert_pem)
    key_file.write_bytes(first.key_pem)
    served = serve(str(cert_file), str(key_file))
    assert served.served_der() == first.der
    kept = served.connection()
    assert echo(kept) == 200

    renewed = pki.pair(days=40, key=first.key)  # renewed with the key kept: one file changes
    replace_file(cert_file, renewed.cert_pem)

    poll(lambda: served.served_der() == renewed.der, what="the renewed certificate on a new connection")
    assert echo(kept) == 200  # the connection opened before the renewal still answers...
    assert kept.sock.getpeercert(binary_form=True) == first.der  # ...with the certificate of its handshake
    assert served.loaded() == 1 and served.failed() == 0
    assert served.sample(EXPIRATION) == renewed.cert.not_valid_after_utc.timestamp()
    kept.close()


def test_a_kubelet_symlink_swap_of_certificate_and_key_is_picked_up(tmp_path, pki, serve):
    first, renewed = pki.pair(days=20), pki.pair(days=40)
    volume = SecretVolume(tmp_path / "tls", {"tls.crt": first.cert_pem, "tls.key": first.key_pem, "ca.crt": pki.ca.pem})
    served = serve(volume.path("tls.crt"), volume.path("tls.key"), volume.path("ca.crt"))
    assert served.served_der() == first.der

    volume.update({"tls.crt": renewed.cert_pem, "tls.key": renewed.key_pem, "ca.crt": pki.ca.pem})

    poll(lambda: served.served_der() == renewed.der, what="the swapped-in certificate on a new connection")
    with closing(served.connection()) as conn:
        assert echo(conn) == 200
    assert served.loaded() == 1 and served.failed() == 0


def test_the_reloaded_context_keeps_http2_and_client_certificate_authentication(tmp_path, pki, serve):
    first, renewed = pki.pair(days=20), pki.pair(days=40)
    volume = SecretVolume(tmp_path / "tls", {"tls.crt": first.cert_pem, "tls.key": first.key_pem})
    served = serve(volume.path("tls.crt"), volume.path("tls.key"))
    volume.update({"tls.crt": renewed.cert_pem, "tls.key": renewed.key_pem})
    poll(lambda: served.served_der() == renewed.der, what="the swapped-in certificate")

    h2 = Client(served.server.port, pki.ca_file, (pki.client_cert, pki.client_key), alpn=("h2", "http/1.1"))
    assert h2.protocol == "h2"
    assert h2.answer(h2.send("POST", "/echo", b"{}"))[0] == 200
    h2.close()
    with closing(served.connection(certificate=False)) as anonymous:
        assert echo(anonymous) == 401  # no client certificate: only the open paths answer
    with closing(served.connection(certificate=False)) as probe:
        probe.request("GET", "/healthz")
        assert probe.getresponse().status == 200
    stranger = Ca("someone-else")
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "stranger.crt").write_bytes(stranger.leaf(stranger_key, 5, client=True).public_bytes(serialization.Encoding.PEM))
    (tmp_path / "stranger.key").write_bytes(_pem(stranger_key))
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    ctx.load_cert_chain(str(tmp_path / "stranger.crt"), str(tmp_path / "stranger.key"))
    with pytest.raises((ssl.SSLError, ConnectionError)):  # another CA's client certificate fails the handshake
        with socket.create_connection(("127.0.0.1", served.server.port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                tls.recv(1)


def test_a_key_that_does_not_match_keeps_the_old_certificate_counts_one_error_and_a_good_pair_is_taken_later(
        tmp_path, pki, serve, caplog):
    first, other, renewed = pki.pair(days=20), pki.pair(days=30), pki.pair(days=40)
    volume = SecretVolume(tmp_path / "tls", {"tls.crt": first.cert_pem, "tls.key": first.key_pem})
    served = serve(volume.path("tls.crt"), volume.path("tls.key"))

    volume.update({"tls.crt": other.cert_pem, "tls.key": first.key_pem})  # the certificate of another key

    poll(lambda: served.failed() == 1, what="the failed reload to be counted")
    assert served.served_der() == first.der
    with closing(served.connection()) as conn:
        assert echo(conn) == 200
    assert served.sample(f"{PREFIX}_serving_certificate_last_reload_success") == 0
    assert served.sample(EXPIRATION) == first.cert.not_valid_after_utc.timestamp()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "does not match the certificate" in errors[0] and "tls.key" in errors[0], errors
    assert served.server.certificate is not None and not served.server.certificate.check()  # unchanged: not tried again
    assert served.failed() == 1

    volume.update({"tls.crt": renewed.cert_pem, "tls.key": renewed.key_pem})

    poll(lambda: served.served_der() == renewed.der, what="the good pair after the bad one")
    assert served.sample(f"{PREFIX}_serving_certificate_last_reload_success") == 1
    assert served.sample(EXPIRATION) == renewed.cert.not_valid_after_utc.timestamp()
    assert served.failed() == 1 and served.loaded() == 1


@pytest.mark.parametrize("broken, named", [
    ("truncated certificate", "certificate file"),
    ("garbage key", "private key file"),
    ("empty certificate", "certificate file"),
])
def test_a_truncated_or_garbage_file_keeps_the_old_certificate_and_is_counted(tmp_path, pki, serve, caplog, broken, named):
    first, renewed = pki.pair(days=20), pki.pair(days=40)
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert_file.write_bytes(first.cert_pem)
    key_file.write_bytes(first.key_pem)
    served = serve(str(cert_file), str(key_file))

    if broken == "truncated certificate":
        replace_file(cert_file, renewed.cert_pem[: len(renewed.cert_pem) // 2])
    elif broken == "garbage key":
        replace_file(key_file, b"-----BEGIN PRIVATE KEY-----\nnot base64 at all\n-----END PRIVATE KEY-----\n")
    else:
        replace_file(cert_file, b"")

    poll(lambda: served.failed() == 1, what="the failed reload to be counted")
    assert served.served_der() == first.der
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and named in errors[0], errors

    replace_file(key_file, renewed.key_pem)  # the key first: certificate and key disagree until the next line
    replace_file(cert_file, renewed.cert_pem)
    poll(lambda: served.served_der() == renewed.der, what="the good pair after the broken file")
    assert served.sample(f"{PREFIX}_serving_certificate_last_reload_success") == 1


def test_the_expiry_gauge_is_the_served_certificates_not_after_from_the_start(tmp_path, pki, serve):
    pair = pki.pair(days=13)
    (tmp_path / "tls.crt").write_bytes(pair.cert_pem)
    (tmp_path / "tls.key").write_bytes(pair.key_pem)
    served = serve(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    not_after = (NOW + datetime.timedelta(days=13)).timestamp()
    assert served.sample(EXPIRATION) == not_after == pair.cert.not_valid_after_utc.timestamp()
    assert served.sample(f"{PREFIX}_serving_certificate_last_reload_success") == 1
    assert served.loaded() == 0 and served.failed() == 0  # the start is not a reload


def test_a_file_that_does_not_load_at_start_stops_the_server_naming_it(tmp_path, pki):
    pair, other = pki.pair(days=20), pki.pair(days=20)
    (tmp_path / "tls.crt").write_bytes(pair.cert_pem)
    (tmp_path / "tls.key").write_bytes(other.key_pem)
    with pytest.raises(CertificateError, match=r"private key file .*tls\.key: does not match the certificate"):
        JsonServer("127.0.0.1", 0, routes(), str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    with pytest.raises(CertificateError, match=r"certificate file .*missing\.crt: cannot read it"):
        ServingCertificate(CertificateFiles(str(tmp_path / "missing.crt"), str(tmp_path / "tls.key")))
    (tmp_path / "tls.key").write_bytes(pair.key_pem)
    (tmp_path / "ca.crt").write_bytes(b"not a CA\n")
    with pytest.raises(CertificateError, match=r"client CA file .*ca\.crt: no CA certificate"):
        ServingCertificate(CertificateFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(tmp_path / "ca.crt")))


def test_the_webhook_command_names_a_certificate_that_does_not_load_in_one_line(tmp_path, pki):
    """The command's answer, not a traceback: one line naming the file and what is wrong with it."""
    import subprocess
    import sys

    pair, other = pki.pair(days=20), pki.pair(days=20)
    (tmp_path / "tls.crt").write_bytes(pair.cert_pem)
    (tmp_path / "tls.key").write_bytes(other.key_pem)
    from tests.k8s.controlplane import free_port

    done = subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "webhook", "serve", "--address", "127.0.0.1", "--port", str(free_port()),
                           "--tls-cert-file", str(tmp_path / "tls.crt"), "--tls-private-key-file", str(tmp_path / "tls.key"),
                           "--client-ca-file", str(pki.ca_file)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("qgpu webhook serve: private key file ") and "does not match the certificate" in lines[0]


def _exposed(page: str, name: str) -> float:
    return float(next(line.split()[1] for line in page.splitlines() if line.startswith(name + " ")))


def test_the_extender_exposes_its_certificates_expiry_on_its_metrics_endpoint(tmp_path):
    from tests.extender.test_extender_cli import served_extender
    from tests.k8s.pki import CertificateAuthority

    ca = CertificateAuthority(tmp_path / "pki")
    serving = ca.issue("extender", "extender", server=True, hosts=("127.0.0.1",))
    scheduler = ca.issue("scheduler", "system:kube-scheduler", client=True)
    server = served_extender(tmp_path, ("--tls-cert-file", str(serving.cert), "--tls-private-key-file", str(serving.key),
                                        "--client-ca-file", str(ca.cert_path)))
    try:
        client = Client(server.port, ca.cert_path, (scheduler.cert, scheduler.key), alpn=("h2", "http/1.1"))
        status, page = client.answer(client.send("GET", "/metrics"))
        client.close()
    finally:
        server.stop()
    assert status == 200
    not_after = x509.load_pem_x509_certificate(serving.cert.read_bytes()).not_valid_after_utc.timestamp()
    assert _exposed(page.decode(), "qgpu_extender_serving_certificate_expiration_timestamp_seconds") == not_after
    assert _exposed(page.decode(), "qgpu_extender_serving_certificate_last_reload_success") == 1


def test_a_plain_http_extender_exposes_no_certificate_series_an_alert_would_read_as_expired(tmp_path):
    """Review finding: over --insecure-plain-http the series were there at 0 (a notAfter of 1970,
    a failed reload), so both documented alerts fired on a server with no certificate at all."""
    import urllib.request

    from tests.extender.test_extender_cli import served_extender

    server = served_extender(tmp_path)
    try:
        page = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    finally:
        server.stop()
    assert "qgpu_extender_cached_nodes" in page and "serving_certificate" not in page


def test_a_key_of_a_kind_the_server_cannot_read_is_a_counted_failure_and_the_old_certificate_stays(tmp_path, pki, monkeypatch):
    """Review finding: cryptography's UnsupportedAlgorithm (an SM2 key, say) is no ValueError: it
    escaped the reload, which then counted nothing, left last_reload_success at 1 and did not look at
    the files again until they changed once more."""
    from cryptography.exceptions import UnsupportedAlgorithm

    from qgpu_runtime import servingcert

    first, second = pki.pair(days=20), pki.pair(days=40)
    (tmp_path / "tls.crt").write_bytes(first.cert_pem)
    (tmp_path / "tls.key").write_bytes(first.key_pem)
    registry = CollectorRegistry()
    metrics = CertificateMetrics.create(registry, "qgpu_test")
    served = ServingCertificate(CertificateFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")), metrics=metrics)
    real_load = servingcert.serialization.load_pem_private_key

    def unsupported(data, password=None):
        raise UnsupportedAlgorithm("sm2 is not supported")

    monkeypatch.setattr(servingcert.serialization, "load_pem_private_key", unsupported)
    replace_file(tmp_path / "tls.key", second.key_pem)
    replace_file(tmp_path / "tls.crt", second.cert_pem)
    assert served.check() is False
    assert registry.get_sample_value("qgpu_test_serving_certificate_reloads_total", {"result": "failed"}) == 1
    assert registry.get_sample_value("qgpu_test_serving_certificate_last_reload_success") == 0
    assert served.not_after == first.cert.not_valid_after_utc.timestamp()
    monkeypatch.setattr(servingcert.serialization, "load_pem_private_key", real_load)
    with pytest.raises(CertificateError, match="unsupported kind"):
        monkeypatch.setattr(servingcert.serialization, "load_pem_private_key", unsupported)
        ServingCertificate(CertificateFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")))


def test_the_webhook_exposes_its_certificates_expiry_to_its_client_ca_only(tmp_path, pki):
    from qgpu_runtime.webhook import cli as webhook_cli
    from qgpu_runtime.webhook.admission import WebhookConfig

    pair = pki.pair(days=25)
    (tmp_path / "tls.crt").write_bytes(pair.cert_pem)
    (tmp_path / "tls.key").write_bytes(pair.key_pem)
    registry = CollectorRegistry()
    server = JsonServer("127.0.0.1", 0, webhook_cli.routes(WebhookConfig(None), registry=registry),
                        str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), limits=webhook_cli.WEBHOOK_LIMITS,
                        client_ca_file=str(pki.ca_file), http2=False,
                        certificate_metrics=CertificateMetrics.create(registry, "qgpu_webhook"))
    server.start()
    served = Served(server, registry, pki)
    try:
        with closing(served.connection()) as apiserver:
            apiserver.request("GET", "/metrics")
            response = apiserver.getresponse()
            page = response.read().decode()
        assert response.status == 200
        assert _exposed(page, "qgpu_webhook_serving_certificate_expiration_timestamp_seconds") == \
            pair.cert.not_valid_after_utc.timestamp()
        with closing(served.connection(certificate=False)) as anonymous:
            anonymous.request("GET", "/metrics")
            assert anonymous.getresponse().status == 401
    finally:
        server.stop()
