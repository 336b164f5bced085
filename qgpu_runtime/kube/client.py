"""Building an API client from a kubeconfig, or from the pod's service account in a cluster."""

from __future__ import annotations

from typing import Any

from kubernetes import client, config

from qgpu_runtime.kube import apijson

REQUEST_TIMEOUT = (3.0, 10.0)  # connect, read seconds: a hung apiserver must not hang a bind


def api_client(kubeconfig: str | None, pool_size: int = 32) -> client.ApiClient:
    """An ApiClient for ``kubeconfig``, or in-cluster config when it is None."""
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        config.load_incluster_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)


def raw_json(response: Any) -> Any:
    """Body of a call made with ``_preload_content=False``: plain dicts, no model objects.

    The extender works on API JSON (as the parser does), which also skips the client's slow
    model deserialisation. Decoded by :func:`~qgpu_runtime.kube.apijson.loads`: a tenant's
    free-form value nested past the decoder's reach does not fail the whole body.
    """
    return apijson.loads(response.data)


def drain(response: Any) -> None:
    """Finish a ``_preload_content=False`` call whose body we do not need.

    urllib3 returns a connection to the pool only once its response was read to the end; an
    unread one is dropped, and the next call pays a new TCP and TLS handshake with the apiserver.
    """
    try:
        response.read()
    finally:
        response.release_conn()
