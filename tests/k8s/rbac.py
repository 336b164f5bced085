"""Running a qgpu component with exactly the ClusterRole its deployment template grants.

Most tests run components as the cluster admin, which hides any call the role does not allow; the
RBAC tests render the role from templates/kubernetes/ and run the component as a user bound only
to it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import yaml
from kubernetes import client

from tests.k8s.conftest import Cluster
from tests.k8s.controlplane import ROOT, kubeconfig


def _template_docs(template: str, **variables: Any) -> list[dict[str, Any]]:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(ROOT / "templates" / "kubernetes")),
                             undefined=jinja2.StrictUndefined)
    env.filters["to_json"] = json.dumps
    env.filters["combine"] = lambda a, b: {**a, **b}
    env.filters["bool"] = lambda v: v is True or str(v).strip().lower() in ("yes", "on", "1", "true", "y", "t")
    text = env.get_template(template).render(ansible_managed="test", **variables)
    return [d for d in yaml.safe_load_all(text) if d]


def template_cluster_role(template: str, **variables: Any) -> dict[str, Any]:
    """The ClusterRole of ``templates/kubernetes/<template>``, rendered as the roles render it."""
    (role,) = [d for d in _template_docs(template, **variables) if d["kind"] == "ClusterRole"]
    return role


def template_roles(template: str, **variables: Any) -> list[dict[str, Any]]:
    """The namespaced Roles of ``templates/kubernetes/<template>`` (e.g. the extender's Lease Role)."""
    return [d for d in _template_docs(template, **variables) if d["kind"] == "Role"]


def bind_roles(cluster: Cluster, roles: list[dict[str, Any]], name: str) -> None:
    """Create each namespaced Role as ``name`` in its namespace, bound to user ``name`` (made by
    :func:`kubeconfig_bound_to`). Undo with :func:`unbind_roles`."""
    rbac = client.RbacAuthorizationV1Api(cluster.api_client)
    for role in roles:
        namespace = role["metadata"]["namespace"]
        rbac.create_namespaced_role(namespace, {**role, "metadata": {**role["metadata"], "name": name}})
        rbac.create_namespaced_role_binding(namespace, {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": name}]})


def unbind_roles(cluster: Cluster, roles: list[dict[str, Any]], name: str) -> None:
    rbac = client.RbacAuthorizationV1Api(cluster.api_client)
    for role in roles:
        rbac.delete_namespaced_role_binding(name, role["metadata"]["namespace"])
        rbac.delete_namespaced_role(name, role["metadata"]["namespace"])


def kubeconfig_bound_to(cluster: Cluster, role: dict[str, Any], name: str, path: Path) -> Path:
    """Create ``role`` as ClusterRole ``name``, bind it to a new user ``name`` with a client
    certificate, and write that user's kubeconfig to ``path``. Undo with :func:`unbind`."""
    rbac = client.RbacAuthorizationV1Api(cluster.api_client)
    rbac.create_cluster_role({**role, "metadata": {**role["metadata"], "name": name}})
    rbac.create_cluster_role_binding({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": name}]})
    cp = cluster.cp
    pair = cp.ca.issue(name, name, client=True)
    path.write_text(yaml.safe_dump(kubeconfig(cp.server, cp.ca.cert_path, pair, name)))
    return path


def unbind(cluster: Cluster, name: str) -> None:
    rbac = client.RbacAuthorizationV1Api(cluster.api_client)
    rbac.delete_cluster_role_binding(name)
    rbac.delete_cluster_role(name)
