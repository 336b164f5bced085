"""An HTTP/2 client driven frame by frame (the h2 library over a TLS socket), for tests that
need a client to misbehave exactly as they say."""

from __future__ import annotations

import json
import socket
import ssl
import time
from pathlib import Path
from typing import Any

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, DataReceived, ResponseReceived, StreamEnded, StreamReset
from h2.settings import SettingCodes, Settings

from tests.k8s.pki import CertificateAuthority, KeyPair


class Client:
    """One HTTP/2 connection, driven by hand."""

    def __init__(self, port: int, ca_file: Path, cert: tuple[Path, Path] | None, *, window: int | None = None,
                 alpn: tuple[str, ...] = ("h2",)):
        ctx = ssl.create_default_context(cafile=str(ca_file))
        if cert is not None:
            ctx.load_cert_chain(str(cert[0]), str(cert[1]))
        ctx.set_alpn_protocols(list(alpn))
        self.sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="127.0.0.1")
        self.protocol = self.sock.selected_alpn_protocol()
        self.conn = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        if window is not None:  # in force from the first frame (a setter would wait for the server's ACK)
            self.conn.local_settings = Settings(client=True, initial_values={SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.status: dict[int, int] = {}
        self.bodies: dict[int, bytearray] = {}
        self.ended: set[int] = set()
        self.reset: set[int] = set()
        self.terminated: ConnectionTerminated | None = None
        self.acknowledge = True  # credit what arrives (open the window again)

    def send(self, method: str, path: str, body: bytes = b"", *, end: bool = True, length: int | str | None = None) -> int:
        sid = self.conn.get_next_available_stream_id()
        headers = [(":method", method), (":path", path), (":scheme", "https"), (":authority", "127.0.0.1")]
        if length is not None:
            headers.append(("content-length", str(length)))
        self.conn.send_headers(sid, headers, end_stream=end and not body)
        if body:
            self.conn.send_data(sid, body, end_stream=end)
        self.sock.sendall(self.conn.data_to_send())
        return sid

    def more(self, sid: int, data: bytes, *, end: bool = False) -> None:
        self.conn.send_data(sid, data, end_stream=end)
        self.sock.sendall(self.conn.data_to_send())

    def pump(self, until: Any, timeout: float = 10.0) -> bool:
        """Reads until ``until()`` holds (True), the server closes (False) or the timeout (raises)."""
        deadline = time.monotonic() + timeout
        while not until():
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                raise AssertionError("no answer in time") from None
            if not data:
                return False
            for event in self.conn.receive_data(data):
                if isinstance(event, ResponseReceived):
                    self.status[event.stream_id] = int(dict(event.headers)[":status"])
                elif isinstance(event, DataReceived):
                    self.bodies.setdefault(event.stream_id, bytearray()).extend(event.data)
                    if self.acknowledge:
                        self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, StreamEnded):
                    self.ended.add(event.stream_id)
                elif isinstance(event, StreamReset):
                    self.reset.add(event.stream_id)
                elif isinstance(event, ConnectionTerminated):
                    self.terminated = event
            out = self.conn.data_to_send()
            if out:
                self.sock.sendall(out)
        return True

    def answer(self, sid: int) -> tuple[int, Any]:
        assert self.pump(lambda: sid in self.ended), "the server closed the connection"
        body = bytes(self.bodies.get(sid, b""))
        return self.status[sid], json.loads(body) if body.startswith((b"{", b"[")) else body

    def closed(self, timeout: float = 10.0) -> bool:
        """True once the server has closed the connection."""
        try:
            return not self.pump(lambda: False, timeout)
        except (ConnectionError, ssl.SSLError):
            return True

    def close(self) -> None:
        self.sock.close()


def connect(port: int, pki: tuple[CertificateAuthority, KeyPair, KeyPair], *, certificate: bool = True, **kwargs: Any) -> Client:
    """A :class:`Client` trusting ``pki``'s CA and presenting its client certificate (or none)."""
    ca, _, client = pki
    return Client(port, ca.cert_path, (client.cert, client.key) if certificate else None, **kwargs)
