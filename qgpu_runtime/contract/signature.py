"""The allocation record's signature (annotation ``qgpu.io/allocation-signature``): sign, verify.

Why: a pod's annotations are written by the pod's owner, a tenant with ``edit`` in its namespace,
at create and at update. Without proof of origin a tenant could create a pod with ``spec.nodeName``
set and its own ``qgpu.io/allocation`` granting a whole card, and the device plugin would serve it;
or park unscheduled pods whose records book every card of a node in the extender's cache. So the
extender signs every record it writes with an Ed25519 key only it holds, and every reader (the
device plugin's Allocate matching, the extender's cache rebuild, ``qgpu status``) believes a record
only when the signature verifies with the public key.

What is signed: the pod's UID (a record copied to another pod fails), the node of the Binding, the
record's JSON exactly as stored and the bind-time annotation exactly as stored (so neither can be
edited, and a bind-time far in the future cannot keep an assumed record alive). The message is a
JSON array with a domain tag, so no two different inputs share a message.

Rolling upgrades: the signature is a new annotation beside the record; readers of earlier releases
ignore it (docs/annotations.md, "Versions"). Pure: keys come in as PEM bytes; nothing here reads
files or talks to the API.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from qgpu_runtime.contract.names import ALLOCATION, ALLOCATION_SIGNATURE, BIND_TIME
from qgpu_runtime.contract.record import AllocationRecord, RecordError, annotations, parse_record
from qgpu_runtime.model.quantity import show_value

__all__ = ["ALLOCATION_SIGNATURE", "SigningKeyError", "RecordSigner", "RecordVerifier", "UntrustedRecord", "signed_annotations",
           "trusted_record"]

SIGNATURE_PREFIX = "ed25519.v1."
"""Scheme and version of the value; a later scheme gets another prefix and readers name what they read."""
_DOMAIN = "qgpu.io/allocation-signature/v1"
_MAX_SIGNATURE_CHARS = 128  # an Ed25519 signature is 64 bytes, 86 characters of base64url
VERIFIED_MEMO = 4096
"""Signatures a verifier remembers as good: a pod's record is re-read on every watch event of the
pod (bound, then each status write), each a verification of the same bytes (~0.1 ms of CPU). The
extender's own signatures enter as it makes them (:meth:`RecordSigner.sign` with ``known_to``), so
the watch event that brings its bind back is not verified either (~0.2 ms on a slow core)."""


class UntrustedRecord(RecordError):
    """A record qgpu cannot prove it wrote; the message names the annotation, the value and the rule."""


class SigningKeyError(ValueError):
    """A signing or verification key that cannot be used; the message names the key and the rule."""


def _message(pod_uid: str, node: str, record_raw: str, bind_time_raw: str) -> bytes:
    return json.dumps([_DOMAIN, pod_uid, node, record_raw, bind_time_raw], separators=(",", ":")).encode()


def _memo_key(message: bytes, signature: str) -> bytes:
    # JSON text (ASCII, escaped) holds no raw newline; surrogatepass: a lone surrogate decoded
    # from the pod's JSON is hashed, and then refused by base64, not an exception here
    return hashlib.sha256(message + b"\n" + signature.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class RecordVerifier:
    """The extender's public key: believes what the extender signed and nothing else."""

    public_key: Ed25519PublicKey
    # SHA-256 of (message, signature) pairs that verified with this key, oldest first: 32 bytes each
    # whatever the record's size. Only good ones: a verification is a pure function of the key, the
    # message and the signature, so a remembered one is the answer the key would give again; a bad
    # one is checked (and refused) every time.
    _verified: dict[bytes, None] = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @classmethod
    def from_pem(cls, pem: bytes, source: str = "public key") -> RecordVerifier:
        try:
            key = serialization.load_pem_public_key(pem)
        except (ValueError, TypeError) as exc:
            raise SigningKeyError(f"{source}: not a PEM public key ({exc})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise SigningKeyError(f"{source}: a {type(key).__name__} key; record signatures need an Ed25519 public key")
        return cls(key)

    def verify(self, pod_uid: str, node: str, record_raw: str, bind_time_raw: str, signature: str) -> None:
        """Raises :class:`UntrustedRecord` unless ``signature`` is the extender's over exactly these."""
        if not signature.startswith(SIGNATURE_PREFIX) or len(signature) > _MAX_SIGNATURE_CHARS:
            raise UntrustedRecord(f"{ALLOCATION_SIGNATURE}={signature[:40]!r}: not a signature this qgpu reads "
                                  f"(expected {SIGNATURE_PREFIX}<base64url Ed25519 signature>)")
        message = _message(pod_uid, node, record_raw, bind_time_raw)
        key = _memo_key(message, signature)
        if key in self._verified:
            return
        self._verify(message, pod_uid, node, bind_time_raw, signature)
        self._remember(key)

    def learn_signed(self, message: bytes, signature: str, signer: RecordSigner) -> None:
        """``signer`` has just signed ``message``: remembered as good when its public half is this
        verifier's key (then verifying would give that answer); any other signer's is not kept."""
        if signer.public_raw == self.public_raw:
            self._remember(_memo_key(message, signature))

    @cached_property
    def public_raw(self) -> bytes:
        return self.public_key.public_bytes_raw()

    def _remember(self, key: bytes) -> None:
        with self._lock:
            if len(self._verified) >= VERIFIED_MEMO:
                del self._verified[next(iter(self._verified))]
            self._verified[key] = None

    def _verify(self, message: bytes, pod_uid: str, node: str, bind_time_raw: str, signature: str) -> None:
        try:
            raw = base64.urlsafe_b64decode(signature[len(SIGNATURE_PREFIX):] + "==")
        except (binascii.Error, ValueError):
            raise UntrustedRecord(f"{ALLOCATION_SIGNATURE}: not base64url") from None
        try:
            self.public_key.verify(raw, message)
        except InvalidSignature:
            raise UntrustedRecord(
                f"{ALLOCATION_SIGNATURE}: does not verify for pod uid {show_value(repr(pod_uid))} on node "
                f"{show_value(repr(node))} with this record and {BIND_TIME}={show_value(repr(bind_time_raw))}: a record "
                "is believed only as the extender signed it for this pod "
                "(edited, copied from another pod, or signed with another key)") from None

    def pem(self) -> bytes:
        return self.public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class RecordSigner:
    """The extender's private key. Only the extender holds it (the roles mount it nowhere else)."""

    private_key: Ed25519PrivateKey

    @classmethod
    def from_pem(cls, pem: bytes, source: str = "private key") -> RecordSigner:
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise SigningKeyError(f"{source}: not an unencrypted PEM private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SigningKeyError(f"{source}: a {type(key).__name__} key; record signatures need an Ed25519 private key")
        return cls(key)

    @property
    def verifier(self) -> RecordVerifier:
        return RecordVerifier(self.private_key.public_key())

    @cached_property
    def public_raw(self) -> bytes:
        return self.private_key.public_key().public_bytes_raw()

    def sign(self, pod_uid: str, node: str, record_raw: str, bind_time_raw: str,
             known_to: RecordVerifier | None = None) -> str:
        """The signature; ``known_to``: a verifier that remembers it as good (when it holds this
        key's public half), so reading this record back costs it no verification."""
        message = _message(pod_uid, node, record_raw, bind_time_raw)
        signature = SIGNATURE_PREFIX + base64.urlsafe_b64encode(self.private_key.sign(message)).decode().rstrip("=")
        if known_to is not None:
            known_to.learn_signed(message, signature, self)
        return signature


def signed_annotations(record: AllocationRecord, epoch_ns: int, pod_uid: str, signer: RecordSigner,
                       known_to: RecordVerifier | None = None) -> dict[str, str]:
    """The annotations one bind writes, in one request: record, bind-time and their signature
    (remembered by ``known_to``, see :meth:`RecordSigner.sign`)."""
    record_raw, bind_time_raw = record.to_json(), str(epoch_ns)
    return {ALLOCATION: record_raw, BIND_TIME: bind_time_raw,
            ALLOCATION_SIGNATURE: signer.sign(pod_uid, record.node, record_raw, bind_time_raw, known_to)}


def trusted_record(pod: Mapping[str, Any], verifier: RecordVerifier) -> AllocationRecord | None:
    """The pod's record if qgpu wrote it for this pod; None when it carries none.

    Raises :class:`RecordError` for a malformed record and :class:`UntrustedRecord` for one that is
    unsigned, signed for another pod, node or bind-time, or bound to a node other than its own.
    """
    notes = annotations(pod)
    raw = notes.get(ALLOCATION)
    if raw is None:
        return None
    signature = notes.get(ALLOCATION_SIGNATURE)
    if not isinstance(signature, str) or not signature:
        raise UntrustedRecord(f"{ALLOCATION_SIGNATURE} is missing: a {ALLOCATION} record is believed only when the "
                              "extender signed it (a pod's own annotations are its owner's to write)")
    record = parse_record(raw)
    bound_to = (pod.get("spec") or {}).get("nodeName")
    if bound_to and bound_to != record.node:
        raise UntrustedRecord(f"{ALLOCATION}: node={show_value(repr(record.node))} but the pod is bound to {show_value(repr(bound_to))}: a record is "
                              "believed only on the node it names")
    uid = str((pod.get("metadata") or {}).get("uid") or "")
    verifier.verify(uid, record.node, raw, str(notes.get(BIND_TIME, "")), signature)
    return record
