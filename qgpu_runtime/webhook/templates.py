"""The webhook's one write: the ResourceClaimTemplates converted pods refer to (resource.k8s.io/v1).

Idempotent: a template is named after its shape, so an existing one with that name is the same
template, unless someone changed it; that is refused rather than overwritten, because pods admitted
earlier were promised what it said. The apiserver defaults fields the webhook leaves out, so the
stored template must contain what the webhook would write, not equal it.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from kubernetes import client

from qgpu_runtime.kube.client import REQUEST_TIMEOUT, drain, raw_json
from qgpu_runtime.kube.errors import ApiError, Conflict, NotFound, Unreachable, call
from qgpu_runtime.model.quantity import QuantityError, parse_quantity
from qgpu_runtime.webhook.dra import ClaimTemplate, TemplateError

log = logging.getLogger(__name__)


def _same_value(actual: Any, wanted: Any) -> bool:
    """Equal, or the same quantity: the apiserver stores capacity "1000" in canonical form, "1k"."""
    if actual == wanted:
        return True
    if isinstance(actual, str) and isinstance(wanted, str):
        try:
            return parse_quantity(actual) == parse_quantity(wanted)
        except QuantityError:
            return False
    return False


def _contains(actual: Any, wanted: Any) -> bool:
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(_contains(actual.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(actual, list) and len(actual) == len(wanted) and all(_contains(a, w) for a, w in zip(actual, wanted))
    return _same_value(actual, wanted)


class TemplateWriter:
    """Creates missing templates through ``api_client``; ``__call__`` is the ``ensure`` of ``mutate_dra``."""

    def __init__(self, api_client: client.ApiClient):
        self.api = client.ResourceV1Api(api_client)

    def __call__(self, namespace: str, templates: Sequence[ClaimTemplate]) -> None:
        for template in templates:
            self._ensure(namespace, template)

    def _ensure(self, namespace: str, template: ClaimTemplate) -> None:
        """Read first (the common case, one call per pod); create on 404; read again when another
        webhook replica created it in between (409)."""
        where = f"ResourceClaimTemplate {namespace}/{template.name}"
        stored = self._read(where, namespace, template.name)
        if stored is None:
            try:
                drain(call(self.api.create_namespaced_resource_claim_template, namespace, template.manifest(namespace),
                           _preload_content=False, _request_timeout=REQUEST_TIMEOUT))
                log.info("created %s", where)
                return
            except Conflict:
                pass  # another replica created it in between
            except Unreachable as exc:
                raise TemplateError(f"{where}: the apiserver could not be reached: {exc}") from None
            except ApiError as exc:
                raise TemplateError(f"{where}: the apiserver refused to create it: {exc}") from None
            stored = self._read(where, namespace, template.name)
            if stored is None:
                raise TemplateError(f"{where}: the apiserver answered 409 (exists) to the create and 404 to the read; try again")
        if not _contains((stored.get("spec") or {}).get("spec"), template.claim_spec):
            raise TemplateError(f"{where}: exists with another spec than qgpu writes for this shape "
                                f"({json.dumps(template.claim_spec, sort_keys=True)}); delete it and qgpu recreates it")

    def _read(self, where: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return raw_json(call(self.api.read_namespaced_resource_claim_template, name, namespace,
                                 _preload_content=False, _request_timeout=REQUEST_TIMEOUT))
        except NotFound:
            return None
        except Unreachable as exc:
            raise TemplateError(f"{where}: the apiserver could not be reached: {exc}") from None
        except ApiError as exc:
            raise TemplateError(f"{where}: the apiserver refused to read it: {exc}") from None
