"""The allocation record's signature (contract/signature.py): only what the extender signed for
this pod, node, record and bind-time is believed."""

from __future__ import annotations

import copy
import json

import pytest

from qgpu_runtime.contract.names import ALLOCATION, ALLOCATION_SIGNATURE, BIND_TIME
from qgpu_runtime.contract.record import RecordError
from qgpu_runtime.contract.signature import RecordSigner, RecordVerifier, SigningKeyError, UntrustedRecord, signed_annotations, trusted_record
from qgpu_runtime.model.requests import AppClass
from qgpu_runtime.placement.state import CardShare, ContainerPlacement, Placement
from tests.recordkeys import OTHER_SIGNER, SIGNER, VERIFIER, private_pem, signed

UID = "6b1f0d3e-0000-4000-8000-000000000001"
BIND_NS = 1_732_000_000_000_000_000


def _pod(uid: str = UID, node: str | None = "gpu-node-1") -> dict:
    record = Placement("gpu-node-1", (ContainerPlacement("c", (CardShare(0, "GPU-a", 300, 4096),)),),
                       AppClass.NORMAL).record("binpack", BIND_NS)
    return {"metadata": {"name": "p", "namespace": "ns", "uid": uid, "annotations": signed(record, BIND_NS, uid)},
            "spec": {"nodeName": node} if node else {}}


def test_a_record_the_extender_signed_for_this_pod_is_believed():
    record = trusted_record(_pod(), VERIFIER)
    assert record is not None and record.node == "gpu-node-1" and record.containers[0].shares[0].core_milli == 300


def test_an_unbound_pod_s_signed_record_is_believed_for_the_node_it_names():
    assert trusted_record(_pod(node=None), VERIFIER) is not None


def test_a_pod_without_a_record_has_none():
    assert trusted_record({"metadata": {"uid": UID, "annotations": {}}}, VERIFIER) is None


def test_a_missing_signature_is_refused_by_name():
    pod = _pod()
    del pod["metadata"]["annotations"][ALLOCATION_SIGNATURE]
    with pytest.raises(UntrustedRecord, match="qgpu.io/allocation-signature is missing"):
        trusted_record(pod, VERIFIER)


@pytest.mark.parametrize("tamper", [
    pytest.param(lambda d: d["containers"][0]["cards"][0].update(core_milli=1000), id="core share"),
    pytest.param(lambda d: d["containers"][0]["cards"][0].update(memory_mib=32768), id="memory"),
    pytest.param(lambda d: d["containers"][0]["cards"][0].update(index=1), id="card index"),
    pytest.param(lambda d: d.update(policy="spread"), id="policy"),
])
def test_a_tampered_record_field_is_refused(tamper):
    pod = _pod()
    doc = json.loads(pod["metadata"]["annotations"][ALLOCATION])
    tamper(doc)
    pod["metadata"]["annotations"][ALLOCATION] = json.dumps(doc, separators=(",", ":"))
    with pytest.raises(UntrustedRecord, match="does not verify for pod uid"):
        trusted_record(pod, VERIFIER)


def test_a_tampered_bind_time_is_refused():
    pod = _pod()
    pod["metadata"]["annotations"][BIND_TIME] = str(9 * 10**18)
    with pytest.raises(UntrustedRecord, match="bind-time='9000000000000000000'"):
        trusted_record(pod, VERIFIER)


def test_a_record_copied_onto_another_pod_is_refused():
    pod = _pod()
    other = copy.deepcopy(pod)
    other["metadata"]["uid"] = "6b1f0d3e-0000-4000-8000-000000000002"
    with pytest.raises(UntrustedRecord, match="6b1f0d3e-0000-4000-8000-000000000002"):
        trusted_record(other, VERIFIER)


def test_a_record_for_another_node_than_the_pod_is_bound_to_is_refused():
    pod = _pod()
    pod["spec"]["nodeName"] = "gpu-node-2"
    with pytest.raises(UntrustedRecord, match="bound to 'gpu-node-2'"):
        trusted_record(pod, VERIFIER)


def test_a_record_signed_with_another_key_is_refused():
    pod = _pod()
    notes = pod["metadata"]["annotations"]
    notes[ALLOCATION_SIGNATURE] = OTHER_SIGNER.sign(UID, "gpu-node-1", notes[ALLOCATION], notes[BIND_TIME])
    with pytest.raises(UntrustedRecord, match="signed with another key"):
        trusted_record(pod, VERIFIER)


@pytest.mark.parametrize("value", ["", "ed25519.v1.", "ed25519.v1.!!!!", "rsa.v1.AAAA", "ed25519.v1." + "A" * 500])
def test_a_garbled_signature_is_refused(value):
    pod = _pod()
    pod["metadata"]["annotations"][ALLOCATION_SIGNATURE] = value
    with pytest.raises(UntrustedRecord):
        trusted_record(pod, VERIFIER)


def test_a_malformed_record_is_a_record_error_even_when_signed():
    pod = _pod()
    notes = pod["metadata"]["annotations"]
    notes[ALLOCATION] = "{}"
    notes[ALLOCATION_SIGNATURE] = SIGNER.sign(UID, "gpu-node-1", "{}", notes[BIND_TIME])
    with pytest.raises(RecordError, match="version=None"):
        trusted_record(pod, VERIFIER)


def test_keys_load_from_pem_and_refuse_other_kinds():
    assert RecordSigner.from_pem(private_pem()).verifier.pem() == VERIFIER.pem()
    assert RecordVerifier.from_pem(VERIFIER.pem()).pem() == VERIFIER.pem()
    with pytest.raises(SigningKeyError, match="record.pub: not a PEM public key"):
        RecordVerifier.from_pem(b"garbage", "record.pub")
    with pytest.raises(SigningKeyError, match="not an unencrypted PEM private key"):
        RecordSigner.from_pem(VERIFIER.pem())
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    other = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(SigningKeyError, match="need an Ed25519 public key"):
        RecordVerifier.from_pem(other)


class CountingKey:
    """An Ed25519 public key that counts its verifications (and makes them)."""

    def __init__(self, key) -> None:
        self.key, self.calls = key, 0

    def public_bytes_raw(self) -> bytes:
        return self.key.public_bytes_raw()

    def public_bytes(self, *args) -> bytes:  # noqa: ANN002
        return self.key.public_bytes(*args)

    def verify(self, signature: bytes, message: bytes) -> None:
        self.calls += 1
        self.key.verify(signature, message)


def test_a_good_signature_is_verified_once_then_remembered_a_bad_one_every_time():
    key = CountingKey(SIGNER.verifier.public_key)
    verifier = RecordVerifier(key)  # type: ignore[arg-type]
    pod = _pod()
    for _ in range(3):  # the pod's watch events: the same record, signature and bind-time each time
        assert trusted_record(copy.deepcopy(pod), verifier) is not None
    assert key.calls == 1
    bad = copy.deepcopy(pod)
    bad["metadata"]["annotations"][BIND_TIME] = str(BIND_NS + 1)  # signed for another bind-time
    for _ in range(2):
        with pytest.raises(UntrustedRecord, match="does not verify"):
            trusted_record(bad, verifier)
    assert key.calls == 3  # a refusal is never remembered: each attempt is checked, and refused again
    other = copy.deepcopy(pod)
    other["metadata"]["uid"] = "6b1f0d3e-0000-4000-8000-000000000002"  # the same record on another pod
    with pytest.raises(UntrustedRecord, match="does not verify"):
        trusted_record(other, verifier)


def test_the_memory_of_good_signatures_is_bounded(monkeypatch):
    import qgpu_runtime.contract.signature as signature

    monkeypatch.setattr(signature, "VERIFIED_MEMO", 3)
    key = CountingKey(SIGNER.verifier.public_key)
    verifier = RecordVerifier(key)  # type: ignore[arg-type]
    pods = [_pod(uid=f"6b1f0d3e-0000-4000-8000-00000000010{i}") for i in range(5)]
    for pod in pods:
        trusted_record(pod, verifier)
    assert len(verifier._verified) == 3 and key.calls == 5
    trusted_record(pods[0], verifier)  # forgotten (the oldest go first): verified again
    assert key.calls == 6
    trusted_record(pods[4], verifier)  # still remembered
    assert key.calls == 6


def test_a_signature_the_extender_makes_is_remembered_by_its_own_verifier_and_not_verified_again():
    """The bind signs a record, and the watch event that brings it back is checked against the
    verifier's memory: no verification for what this key's holder just signed."""
    key = CountingKey(SIGNER.verifier.public_key)
    verifier = RecordVerifier(key)  # type: ignore[arg-type]
    record = Placement("gpu-node-1", (ContainerPlacement("c", (CardShare(0, "GPU-a", 300, 4096),)),),
                       AppClass.NORMAL).record("binpack", BIND_NS)
    notes = signed_annotations(record, BIND_NS, UID, SIGNER, known_to=verifier)
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": UID, "annotations": notes}, "spec": {"nodeName": "gpu-node-1"}}
    assert trusted_record(pod, verifier) is not None
    assert key.calls == 0
    edited = copy.deepcopy(pod)  # what was signed, not whatever looks like it, is what is remembered
    edited["metadata"]["annotations"][BIND_TIME] = str(BIND_NS + 1)
    with pytest.raises(UntrustedRecord, match="does not verify"):
        trusted_record(edited, verifier)
    assert key.calls == 1


def test_a_signature_made_with_another_key_is_not_remembered_as_good():
    """Only a signer holding the verifier's key teaches it: another key's signature stays refused."""
    verifier = RecordVerifier(SIGNER.verifier.public_key)
    record = Placement("gpu-node-1", (ContainerPlacement("c", (CardShare(0, "GPU-a", 300, 4096),)),),
                       AppClass.NORMAL).record("binpack", BIND_NS)
    notes = signed_annotations(record, BIND_NS, UID, OTHER_SIGNER, known_to=verifier)
    assert not verifier._verified
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": UID, "annotations": notes}, "spec": {"nodeName": "gpu-node-1"}}
    with pytest.raises(UntrustedRecord, match="does not verify"):
        trusted_record(pod, verifier)


@pytest.mark.parametrize("signature", ["ed25519.v1.\ud800" + "A" * 85, "ed25519.v1." + "é" * 86, "ed25519.v1." + "A" * 200])
def test_a_signature_of_odd_characters_is_refused_by_rule_not_by_an_exception(signature):
    """A pod's JSON can carry any string, lone surrogates included; the verifier's memory key must
    not be where such a value raises."""
    pod = _pod()
    pod["metadata"]["annotations"][ALLOCATION_SIGNATURE] = signature
    with pytest.raises(UntrustedRecord):
        trusted_record(pod, VERIFIER)


@pytest.mark.parametrize("tamper", [
    pytest.param(lambda d: d.update({"class": "x" * 200_000}), id="class"),
    pytest.param(lambda d: d["containers"].__setitem__(0, ["x" * 200_000]), id="container"),
    pytest.param(lambda d: d["containers"][0]["cards"][0].update(index="9" * 200_000), id="card index"),
    pytest.param(lambda d: d.update(node="n" * 200_000), id="node"),
])
def test_a_huge_value_in_a_forged_record_comes_back_cut(tamper):
    """The annotation is up to 256 KiB of whatever the pod's owner wrote, and the refusal is logged
    on every event of the pod and kept among the extender's problems: the value is named, cut."""
    pod = _pod(node=None)
    doc = json.loads(pod["metadata"]["annotations"][ALLOCATION])
    tamper(doc)
    pod["metadata"]["annotations"][ALLOCATION] = json.dumps(doc)
    with pytest.raises((UntrustedRecord, RecordError)) as refused:
        trusted_record(pod, VERIFIER)
    assert len(str(refused.value)) < 2000 and "characters)" in str(refused.value)
