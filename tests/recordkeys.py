"""The record-signing key pair of the tests: what the roles generate per cluster, fixed here.

Every fixture that writes an allocation record signs it with ``SIGNER`` (as qgpu's extender does);
the node manager and the extender's cache under test verify with ``VERIFIER``. ``OTHER_SIGNER`` is
a key qgpu does not trust.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from qgpu_runtime.contract.names import ALLOCATION, ALLOCATION_SIGNATURE, BIND_TIME
from qgpu_runtime.contract.record import AllocationRecord
from qgpu_runtime.contract.signature import RecordSigner, signed_annotations

SIGNER = RecordSigner(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
VERIFIER = SIGNER.verifier
OTHER_SIGNER = RecordSigner(Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33))))


def private_pem(signer: RecordSigner = SIGNER) -> bytes:
    return signer.private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption())


def write_keys(folder: Path) -> tuple[Path, Path]:
    """(private key file, public key file) as the roles mount them."""
    folder.mkdir(parents=True, exist_ok=True)
    private, public = folder / "record-signing.key", folder / "record-verify.pub"
    private.write_bytes(private_pem())
    private.chmod(0o600)
    public.write_bytes(VERIFIER.pem())
    return private, public


def signed(record: AllocationRecord, epoch_ns: int, pod_uid: str) -> dict[str, str]:
    return signed_annotations(record, epoch_ns, pod_uid, SIGNER)


def sign_pod(pod: dict[str, Any], signer: RecordSigner = SIGNER) -> dict[str, Any]:
    """Sign the record a pod fixture carries, in place, for the node it names; returns the pod."""
    notes = pod["metadata"]["annotations"]
    raw = notes[ALLOCATION]
    try:
        node = str(json.loads(raw).get("node"))
    except (ValueError, AttributeError):  # a malformed record: signed anyway, so the codec's verdict is tested
        node = str(pod.get("spec", {}).get("nodeName") or "")
    notes[ALLOCATION_SIGNATURE] = signer.sign(str(pod["metadata"].get("uid") or ""), node, raw, notes.get(BIND_TIME, ""))
    return pod
