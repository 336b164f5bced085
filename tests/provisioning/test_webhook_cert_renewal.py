"""qgpu_webhook's PKI over time: a certificate is re-issued when it expires within
``qgpu_webhook_cert_renew_days`` (or its CA was re-issued), and kept otherwise. Before, the role
never re-issued one: 825 days after the first run every GPU pod CREATE was refused (the webhook's
``failurePolicy: Fail``) and running the playbook again did not help.

The role runs for real (PKI, rendering, no apiserver) on localhost under a temporary root, as
tests/provisioning/test_webhook_key_secrecy.py runs it."""

from __future__ import annotations

from pathlib import Path

import yaml
from ansible_tools import ansible_playbook
from cryptography import x509

NAMES = ("ca", "tls", "client-ca", "apiserver-client")


def _run(root: Path, **extra: object) -> None:
    playbook = root / "render.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Render the webhook", "hosts": "all", "gather_facts": False,
        "vars": {"ansible_python_interpreter": "{{ ansible_playbook_python }}", "qgpu_root_prefix": str(root / "root")},
        "tasks": [{"name": "Render without applying", "ansible.builtin.include_role": {"name": "qgpu_webhook"},
                   "vars": {"qgpu_webhook_apply": False, **extra}}],
    }]))
    run = ansible_playbook("-i", "localhost,", "-c", "local", str(playbook))
    assert run.returncode == 0, run.output[-4000:]


def _certs(root: Path) -> dict[str, x509.Certificate]:
    pki = root / "root" / "etc" / "qgpu" / "pki" / "webhook"
    return {name: x509.load_pem_x509_certificate((pki / f"{name}.crt").read_bytes()) for name in NAMES}


def _rollout_annotation(root: Path) -> str:
    docs = yaml.safe_load_all((root / "root" / "etc" / "qgpu" / "manifests" / "qgpu-webhook.yaml").read_text())
    (deployment,) = [d for d in docs if d and d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["metadata"]["annotations"]["qgpu.io/tls-sha256"]


def _serials(root: Path) -> dict[str, int]:
    return {name: cert.serial_number for name, cert in _certs(root).items()}


def test_leaves_expiring_within_the_window_are_reissued_and_others_kept(tmp_path):
    short = {"qgpu_webhook_cert_days": 10, "qgpu_webhook_cert_renew_days": 30}
    _run(tmp_path, **short)
    before, rollout = _serials(tmp_path), _rollout_annotation(tmp_path)
    _run(tmp_path, **short)
    after = _serials(tmp_path)
    assert after["ca"] == before["ca"] and after["client-ca"] == before["client-ca"]  # ten years left: kept
    assert after["tls"] != before["tls"] and after["apiserver-client"] != before["apiserver-client"]
    certs = _certs(tmp_path)
    certs["tls"].verify_directly_issued_by(certs["ca"])
    certs["apiserver-client"].verify_directly_issued_by(certs["client-ca"])
    assert _rollout_annotation(tmp_path) != rollout  # the webhook's pods roll onto the new serving pair
    # with the defaults (825 days, a 30-day window) the next run keeps every one
    _run(tmp_path)
    kept = _serials(tmp_path)
    _run(tmp_path)
    assert _serials(tmp_path) == kept


def test_a_reissued_ca_reissues_the_leaves_it_signs_and_they_verify_against_it(tmp_path):
    short_cas = {"qgpu_webhook_ca_days": 20, "qgpu_webhook_cert_renew_days": 30}  # leaves: 825 days
    _run(tmp_path, **short_cas)
    before, old = _serials(tmp_path), _certs(tmp_path)
    _run(tmp_path, **short_cas)
    after = _serials(tmp_path)
    assert all(after[name] != before[name] for name in NAMES), (before, after)
    certs = _certs(tmp_path)
    for leaf, ca in (("tls", "ca"), ("apiserver-client", "client-ca")):
        certs[leaf].verify_directly_issued_by(certs[ca])
        # the CA keeps its key: whoever still holds the old CA file (the webhook configurations'
        # caBundle, the webhook's --client-ca-file) until the next step of the run trusts the new leaf
        certs[leaf].verify_directly_issued_by(old[ca])
