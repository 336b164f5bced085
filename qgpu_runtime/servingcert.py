"""The serving certificate of a :class:`~qgpu_runtime.serving.JsonServer`, read again when its files
change, so a renewed certificate is served without a restart.

kubelet projects an updated TLS Secret into the pod by an atomic symlink swap (``tls.crt`` →
``..data/tls.crt`` → ``..2026_01_01_00_00_00.123/tls.crt``, ``..data`` renamed over), and
cert-manager's CSI driver or an operator's script replaces the files in place or by rename. So the
files' identity (resolved path, device, inode, mtime, size) is polled, and a change builds a fresh
``ssl.SSLContext`` with exactly the settings of the first (TLS ≥ 1.2, no renegotiation, the same
ALPN offer, the same client CA and verify mode). New connections are wrapped with the newest
context; connections already open keep the one they were accepted with.

A replacement that does not load (a half-written file, a key that does not match the
certificate, garbage) never takes the server down: the previous context stays in use, one error
names the file and the reason, :class:`CertificateMetrics` counts it, and the next change of the
files is tried again. Only the first load, at start, raises.

The certificate's own notAfter is exported as a Unix timestamp, so an alert can fire well before
it passes (docs/operations.md, "Serving certificates: renewal and expiry"). It is a fact of the
certificate, not of this process's clock: every replica reports the same value.
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
import threading
from dataclasses import dataclass
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

# What a file's identity is made of; a change of any part means the file was replaced or rewritten.
FileIdentity = tuple[str, int, int, int, int] | str


class CertificateError(ValueError):
    """A certificate, key or CA file that cannot be served; the message names the file and why."""


@dataclass(frozen=True)
class CertificateFiles:
    """The files a TLS server reads: its certificate (chain, leaf first), its key and, for
    client-certificate authentication, the CA that signs its clients."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def paths(self) -> tuple[str, ...]:
        return (self.cert_file, self.key_file) + ((self.client_ca_file,) if self.client_ca_file else ())

    def identity(self) -> tuple[FileIdentity, ...]:
        """Each file's resolved path, device, inode, mtime and size (or why it cannot be stat'ed)."""
        return tuple(_identity(path) for path in self.paths())


def _identity(path: str) -> FileIdentity:
    resolved = os.path.realpath(path)
    try:
        st = os.stat(resolved)
    except OSError as exc:
        return f"{resolved}: {exc.strerror}"
    return resolved, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


@dataclass
class CertificateMetrics:
    """The serving certificate's series, named after the component (``qgpu_extender``, ``qgpu_webhook``)."""

    expiration: Gauge
    reloads: Counter
    last_reload_success: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry, prefix: str) -> CertificateMetrics:
        metrics = cls(
            expiration=Gauge(f"{prefix}_serving_certificate_expiration_timestamp_seconds",
                             "notAfter of the serving certificate served now (Unix time)", registry=registry),
            reloads=Counter(f"{prefix}_serving_certificate_reloads",
                            "Changes of the serving certificate, key or client CA files by result: loaded (served from "
                            "then on) or failed (the previous certificate is still served)", ["result"], registry=registry),
            last_reload_success=Gauge(f"{prefix}_serving_certificate_last_reload_success",
                                      "1 if the last read of the certificate files loaded, 0 if it failed and the "
                                      "previous certificate is still served", registry=registry),
        )
        for result in ("loaded", "failed"):
            metrics.reloads.labels(result)
        return metrics


@dataclass(frozen=True)
class LoadedContext:
    """A server context and the notAfter of the certificate it serves."""

    context: ssl.SSLContext
    not_after: float  # the leaf certificate's notAfter, Unix time


def load_context(files: CertificateFiles, alpn: Sequence[str] = (), verify_mode: ssl.VerifyMode = ssl.CERT_NONE) -> LoadedContext:
    """A server context from ``files``, or a :class:`CertificateError` naming the file that failed.

    The certificate and key are checked with ``cryptography`` first (OpenSSL's own refusal of a
    truncated file is "PEM lib", naming nothing), then loaded by OpenSSL from the same paths."""
    cert_pem = _read(files.cert_file, "certificate")
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError as exc:
        raise CertificateError(f"certificate file {files.cert_file}: no complete PEM certificate in it "
                               f"(empty, truncated or not a certificate: {exc})") from None
    key_pem = _read(files.key_file, "private key")
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except Exception as exc:  # ValueError, TypeError, and cryptography's UnsupportedAlgorithm (an SM2 key) alike
        raise CertificateError(f"private key file {files.key_file}: not an unencrypted PEM private key this server "
                               f"can read (empty, truncated, not a key or of an unsupported kind: {exc})") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    try:
        matches = key.public_key().public_bytes(*spki) == chain[0].public_key().public_bytes(*spki)
    except Exception as exc:  # a certificate whose key is of a kind cryptography does not support
        raise CertificateError(f"certificate file {files.cert_file}: its public key cannot be compared with the private "
                               f"key in {files.key_file} ({type(exc).__name__}: {exc})") from None
    if not matches:
        raise CertificateError(f"private key file {files.key_file}: does not match the certificate in {files.cert_file} "
                               "(a pair half replaced?)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION  # a connection's peer is the one its handshake verified
    try:
        context.load_cert_chain(files.cert_file, files.key_file)
    except (ssl.SSLError, OSError) as exc:
        raise CertificateError(f"certificate file {files.cert_file} with key file {files.key_file}: OpenSSL refused "
                               f"the pair ({exc})") from None
    if alpn:
        context.set_alpn_protocols(list(alpn))
    if files.client_ca_file:
        try:
            context.load_verify_locations(cafile=files.client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise CertificateError(f"client CA file {files.client_ca_file}: no CA certificate OpenSSL accepts ({exc})") from None
        context.verify_mode = verify_mode
    return LoadedContext(context, chain[0].not_valid_after_utc.timestamp())


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise CertificateError(f"{what} file {path}: cannot read it ({exc.strerror})") from None


class ServingCertificate:
    """The context new connections are wrapped with, replaced when :meth:`check` finds the files
    changed and loading them succeeds. ``context`` is one attribute read: a connection gets either
    the old context or the new one, never a half-built one."""

    def __init__(self, files: CertificateFiles, alpn: Sequence[str] = (), verify_mode: ssl.VerifyMode = ssl.CERT_NONE,
                 metrics: CertificateMetrics | None = None):
        self.files = files
        self._alpn = tuple(alpn)
        self._verify_mode = verify_mode
        self._metrics = metrics
        self._lock = threading.Lock()  # one check at a time
        self._seen = files.identity()  # taken before the read: a change during it is seen next time
        loaded = load_context(files, self._alpn, verify_mode)  # at start a bad file stops the server
        self.context = loaded.context
        self.not_after = loaded.not_after
        if metrics is not None:
            metrics.expiration.set(loaded.not_after)
            metrics.last_reload_success.set(1)

    def check(self) -> bool:
        """Load the files again if they changed since the last look; True if a new context is served."""
        with self._lock:
            identity = self.files.identity()
            if identity == self._seen:
                return False
            self._seen = identity
            try:
                loaded = load_context(self.files, self._alpn, self._verify_mode)
            except CertificateError as exc:
                if self.files.identity() != identity:
                    # replaced again while it was read (two files written one after the other):
                    # the next check reads the newer files; not an error of its own
                    log.debug("serving certificate files changed while read, reading them again next time: %s", exc)
                    return False
                log.error("serving certificate not reloaded, still serving the previous one (notAfter %s): %s",
                          _utc(self.not_after), exc)
                if self._metrics is not None:
                    self._metrics.reloads.labels("failed").inc()
                    self._metrics.last_reload_success.set(0)
                return False
            self.context = loaded.context
            self.not_after = loaded.not_after
            if self._metrics is not None:
                self._metrics.expiration.set(loaded.not_after)
                self._metrics.reloads.labels("loaded").inc()
                self._metrics.last_reload_success.set(1)
            log.info("serving certificate reloaded from %s (notAfter %s); new connections get it",
                     self.files.cert_file, _utc(loaded.not_after))
            return True

    def watch(self, stopped: threading.Event, interval_s: float) -> None:
        """:meth:`check` every ``interval_s`` until ``stopped`` is set (a thread's target)."""
        while not stopped.wait(interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the thread must outlive any surprise; the old context still serves
                log.exception("checking the serving certificate files failed; trying again in %.0f s", interval_s)


def _utc(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
