"""Fixtures of the HTTP/2 server tests (test_serving_http2*.py): a CA with a server and a client
certificate, and one certified h2 client connection to the module's ``server`` fixture. A module
that defines a fixture of the same name uses its own."""

from __future__ import annotations

from typing import Iterator

import pytest

from qgpu_runtime.serving import JsonServer
from tests.extender.h2client import Client, connect
from tests.k8s.pki import CertificateAuthority, KeyPair


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[CertificateAuthority, KeyPair, KeyPair]:
    ca = CertificateAuthority(tmp_path_factory.mktemp("h2-pki"))
    return ca, ca.issue("server", "server", server=True, hosts=("127.0.0.1",)), ca.issue("client", "client", client=True)


@pytest.fixture
def client(server: JsonServer, pki: tuple[CertificateAuthority, KeyPair, KeyPair]) -> Iterator[Client]:
    c = connect(server.port, pki)
    yield c
    c.close()
