"""qgpu_scheduler's PKI and manifest: the extender serves HTTPS with client certificates, the
certificates are issued once, re-issued only near expiry, and no private key reaches the output
(issue 11 §3). kube-scheduler running the role's rendered tlsConfig against the real extender:
tests/provisioning/test_k8s_half.py::test_the_role_v1_config_runs_kube_scheduler_through_the_extender."""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import pytest
import yaml
from ansible_tools import REPO, Run, ansible_playbook
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

PLAYBOOK = str(REPO / "tests/provisioning/playbooks/scheduler-tls.yml")
PKI = "etc/qgpu/pki/scheduler"


def run(sandbox: Path, *flags: str, **extra: object) -> Run:
    return ansible_playbook("-i", "localhost,", PLAYBOOK, *flags, "-e", json.dumps({"sandbox": str(sandbox), **extra}))


def cert(sandbox: Path, name: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate((sandbox / PKI / f"{name}.crt").read_bytes())


def manifest(sandbox: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all((sandbox / "etc/qgpu/manifests/qgpu-scheduler.yaml").read_text()) if d]


@pytest.fixture(scope="module")
def issued(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    sandbox = tmp_path_factory.mktemp("scheduler-tls")
    first = run(sandbox, "--diff", "-v")
    assert first.returncode == 0, first.output[-4000:]
    return sandbox, first


def test_the_ca_signs_a_serving_certificate_for_loopback_and_a_client_certificate_for_kube_scheduler(issued):
    sandbox, _ = issued
    ca, serving, client = cert(sandbox, "ca"), cert(sandbox, "tls"), cert(sandbox, "kube-scheduler")
    for leaf in (serving, client):
        leaf.verify_directly_issued_by(ca)
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert list(serving.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:kube-scheduler"
    for key in ("ca.key", "tls.key", "kube-scheduler.key"):
        assert stat.S_IMODE((sandbox / PKI / key).stat().st_mode) == 0o600
    # the masters' copy of the client pair and CA, as kube-scheduler's tlsConfig names them
    master = sandbox / "master/etc/kubernetes/qgpu/pki"
    assert (master / "kube-scheduler.crt").read_bytes() == (sandbox / PKI / "kube-scheduler.crt").read_bytes()
    assert stat.S_IMODE((master / "kube-scheduler.key").stat().st_mode) == 0o600


def secret_fragments(key_file: Path) -> list[str]:
    """Pieces of the key file's PEM text that encode only the private scalar (the file also
    carries the public key, which may be shown), split where the PEM breaks its lines; and the
    scalar in hex."""
    lines = key_file.read_text().splitlines()[1:-1]
    body = "".join(lines)
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    scalar = key.private_numbers().private_value.to_bytes(32, "big")
    der = base64.b64decode(body)
    offset = der.index(scalar)
    first, last = -(-offset // 3) * 3, (offset + 32) // 3 * 3  # whole base64 groups inside the scalar
    start, end = first // 3 * 4, last // 3 * 4
    width = len(lines[0])
    pieces = [body[i:min(end, (i // width + 1) * width)] for i in range(start, end) if i == start or i % width == 0]
    return [p for p in pieces if len(p) >= 12] + [scalar.hex()]


def test_no_private_key_reaches_the_output_or_the_manifest(issued):
    sandbox, first = issued
    rendered = (sandbox / "etc/qgpu/manifests/qgpu-scheduler.yaml").read_text()
    for key in ("ca.key", "tls.key", "kube-scheduler.key"):
        fragments = secret_fragments(sandbox / PKI / key)
        assert len(fragments) >= 2
        for fragment in fragments:
            assert fragment not in first.output, key
            assert fragment not in rendered, key


def test_the_extender_serves_https_and_asks_for_client_certificates(issued):
    sandbox, _ = issued
    (daemonset,) = [d for d in manifest(sandbox) if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert {"--tls-cert-file=/etc/qgpu/tls/tls.crt", "--tls-private-key-file=/etc/qgpu/tls/tls.key",
            "--client-ca-file=/etc/qgpu/tls/ca.crt", "--max-holds=1000", "--group-timeout=60"} <= set(container["args"])
    assert "--insecure-plain-http" not in container["args"]
    assert pod["spec"]["volumes"] == [{"name": "record-key", "secret": {"secretName": "qgpu-record-signing-key"}},
                                      {"name": "tls", "secret": {"secretName": "qgpu-scheduler-tls"}}]
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert len(pod["metadata"]["annotations"]["qgpu.io/tls-checksum"]) == 64


def test_a_second_run_changes_nothing_and_keeps_the_certificates(issued):
    sandbox, _ = issued
    serials = {name: cert(sandbox, name).serial_number for name in ("ca", "tls", "kube-scheduler")}
    record_key = (sandbox / PKI / "record-signing.key").read_bytes()
    again = run(sandbox)
    assert again.returncode == 0 and again.recap_changed() == 0, again.output[-4000:]
    assert {name: cert(sandbox, name).serial_number for name in serials} == serials
    assert (sandbox / PKI / "record-signing.key").read_bytes() == record_key  # never regenerated


def test_the_record_signing_key_is_ed25519_private_and_signs_what_its_public_half_verifies(issued):
    """The pair the extender signs allocation records with (--record-signing-key) and the node
    managers verify them with (--record-verify-key): loadable by qgpu's own codec."""
    from qgpu_runtime.contract.signature import RecordSigner, RecordVerifier

    sandbox, first = issued
    signer = RecordSigner.from_pem((sandbox / PKI / "record-signing.key").read_bytes())
    verifier = RecordVerifier.from_pem((sandbox / PKI / "record-verify.pub").read_bytes())
    verifier.verify("uid", "node", "{}", "1", signer.sign("uid", "node", "{}", "1"))
    assert stat.S_IMODE((sandbox / PKI / "record-signing.key").stat().st_mode) == 0o600
    raw = signer.private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())
    pem_body = "".join((sandbox / PKI / "record-signing.key").read_text().splitlines()[1:-1])
    rendered = (sandbox / "etc/qgpu/manifests/qgpu-scheduler.yaml").read_text()
    for secret in (raw.hex(), base64.b64encode(raw).decode(), pem_body):
        assert secret not in first.output and secret not in rendered
    (daemonset,) = [d for d in manifest(sandbox) if d["kind"] == "DaemonSet"]
    assert "--record-signing-key=/etc/qgpu/record-key/record-signing.key" in daemonset["spec"]["template"]["spec"]["containers"][0]["args"]


def test_certificates_expiring_within_the_renewal_window_are_reissued(tmp_path):
    short = {"qgpu_scheduler_cert_days": 10, "qgpu_scheduler_cert_renew_days": 30}
    assert run(tmp_path, **short).returncode == 0
    before = {name: cert(tmp_path, name).serial_number for name in ("ca", "tls", "kube-scheduler")}
    checksum = manifest(tmp_path)[-1]["spec"]["template"]["metadata"]["annotations"]["qgpu.io/tls-checksum"]
    rotated = run(tmp_path, **short)
    assert rotated.returncode == 0, rotated.output[-4000:]
    after = {name: cert(tmp_path, name).serial_number for name in before}
    assert after["ca"] == before["ca"]  # ten years left: kept
    assert after["tls"] != before["tls"] and after["kube-scheduler"] != before["kube-scheduler"]
    cert(tmp_path, "tls").verify_directly_issued_by(cert(tmp_path, "ca"))
    # the rollout trigger moved with the serving certificate
    assert manifest(tmp_path)[-1]["spec"]["template"]["metadata"]["annotations"]["qgpu.io/tls-checksum"] != checksum


def test_a_reissued_ca_reissues_both_leaves(tmp_path):
    short_ca = {"qgpu_scheduler_ca_days": 20, "qgpu_scheduler_cert_renew_days": 30}  # leaves: a year left
    assert run(tmp_path, **short_ca).returncode == 0
    before = {name: cert(tmp_path, name).serial_number for name in ("ca", "tls", "kube-scheduler")}
    old_ca = cert(tmp_path, "ca")
    rotated = run(tmp_path, **short_ca)
    assert rotated.returncode == 0, rotated.output[-4000:]
    after = {name: cert(tmp_path, name).serial_number for name in before}
    assert all(after[name] != before[name] for name in before), (before, after)
    for leaf in ("tls", "kube-scheduler"):
        cert(tmp_path, leaf).verify_directly_issued_by(cert(tmp_path, "ca"))
        # the CA keeps its key: a kube-scheduler still holding the old CA file trusts the new serving pair
        cert(tmp_path, leaf).verify_directly_issued_by(old_ca)


def test_plain_http_is_refused_off_loopback(tmp_path):
    refused = run(tmp_path, qgpu_scheduler_insecure_plain_http=True, qgpu_scheduler_listen_address="0.0.0.0")
    assert refused.returncode != 0
    assert "qgpu_scheduler_listen_address=0.0.0.0 with qgpu_scheduler_insecure_plain_http=true: plain HTTP is " \
           "served only on a loopback address" in refused.output


def test_plain_http_on_loopback_when_asked_for(tmp_path):
    plain = run(tmp_path, qgpu_scheduler_insecure_plain_http=True)
    assert plain.returncode == 0, plain.output[-4000:]
    (daemonset,) = [d for d in manifest(tmp_path) if d["kind"] == "DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert "--insecure-plain-http" in container["args"] and "--address=127.0.0.1" in container["args"]
    assert not any(a.startswith("--tls-") or a.startswith("--client-ca") for a in container["args"])
    # no certificate is issued; the record signing pair is made whatever the transport
    assert sorted(p.name for p in (tmp_path / PKI).iterdir()) == ["record-signing.key", "record-verify.pub"]
