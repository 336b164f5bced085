"""Running a qgpu component with exactly the ClusterRole its deployment template grants.

Most tests run components as the cluster admin, which hides any call the role does not allow; the
RBAC tests render the role from templates/kubernetes/ and run the component as a user bound only
to it.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import jinja2
import yaml
from kubernetes import client

from tests.k8s.conftest import Cluster
from tests.k8s.controlplane import ROOT, kubeconfig
from tests.polling import poll


def role_defaults(role: str, part: str = "defaults") -> dict[str, Any]:
    """``roles/<role>/<part>/main.yml`` with the inventory-wide fallbacks resolved as a bare
    inventory resolves them (``{{ qgpu_image | default('...') }}`` -> the default); values that need
    Ansible itself (``role_path``) are left out."""
    path = ROOT / "roles" / role / part / "main.yml"
    raw = yaml.safe_load(path.read_text()) if path.exists() else {}
    lenient = jinja2.Environment()
    # what the inventory-derived defaults use (qgpu_scheduler_dra_prioritize): a bare inventory has no GPU nodes
    lenient.filters["bool"] = lambda v: v is True or str(v).strip().lower() in ("yes", "on", "1", "true", "y", "t")
    lenient.filters["extract"] = lambda key, container: container[key]
    out: dict[str, Any] = {}
    for key, value in (raw or {}).items():
        if isinstance(value, str) and "{{" in value:
            try:
                with warnings.catch_warnings():  # Ansible's own escapes ('^127\\.') in vars the templates never use
                    warnings.simplefilter("ignore", DeprecationWarning)
                    value = yaml.safe_load(lenient.from_string(value).render(groups={}, hostvars={})) or ""
            except jinja2.TemplateError:
                continue
        out[key] = value
    return out


def _lookup_file(plugin: str, path: str) -> str:
    """Ansible's ``lookup('ansible.builtin.file', path)``: the file's text without its last newline."""
    if plugin not in ("ansible.builtin.file", "file"):
        raise jinja2.TemplateError(f"lookup plugin {plugin!r} is not rendered outside Ansible")
    return Path(path).read_text().rstrip("\n")


def render_template(template: str, **variables: Any) -> list[dict[str, Any]]:
    """Every object of ``templates/kubernetes/<template>``, rendered as the roles render it: the
    role's defaults (``qgpu-manager.yaml.j2`` -> ``roles/qgpu_manager``), overridden by ``variables``."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(ROOT / "templates" / "kubernetes")),
                             undefined=jinja2.StrictUndefined)
    env.filters["to_json"] = json.dumps
    env.filters["combine"] = lambda a, b: {**a, **b}
    env.filters["bool"] = lambda v: v is True or str(v).strip().lower() in ("yes", "on", "1", "true", "y", "t")
    env.filters["hash"] = lambda text, algorithm: hashlib.new(algorithm, str(text).encode()).hexdigest()
    env.globals["lookup"] = _lookup_file
    role = template.split(".")[0].replace("-", "_")
    # the role's fixed vars (vars/main.yml: names the template shares with the runtime) as well;
    # <role>_templates_dir needs role_path, which only Ansible knows
    values = {f"{role}_templates_dir": str(ROOT / "templates" / "kubernetes"),
              **role_defaults(role), **role_defaults(role, "vars"), **variables}
    text = env.get_template(template).render(ansible_managed="test", **values)
    return [d for d in yaml.safe_load_all(text) if d]


def template_cluster_role(template: str, **variables: Any) -> dict[str, Any]:
    """The ClusterRole of ``templates/kubernetes/<template>``, rendered as the roles render it."""
    (role,) = [d for d in render_template(template, **variables) if d["kind"] == "ClusterRole"]
    return role


def template_roles(template: str, **variables: Any) -> list[dict[str, Any]]:
    """The namespaced Roles of ``templates/kubernetes/<template>`` (e.g. the extender's Lease Role)."""
    return [d for d in render_template(template, **variables) if d["kind"] == "Role"]


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


def edit_user(cluster: Cluster, namespace: str, path: Path) -> client.CoreV1Api:
    """A tenant: a new user ``tenant-<namespace>`` holding the built-in ``edit`` ClusterRole in
    ``namespace`` only (what a team gets for its namespace), its kubeconfig written to ``path``."""
    from kubernetes import config

    user = f"tenant-{namespace}"
    rbac = client.RbacAuthorizationV1Api(cluster.api_client)
    rbac.create_namespaced_role_binding(namespace, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": user},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": _edit_role(rbac)},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})
    cp = cluster.cp
    path.write_text(yaml.safe_dump(kubeconfig(cp.server, cp.ca.cert_path, cp.ca.issue(user, user, client=True), user)))
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {
        "user": user, "resourceAttributes": {"namespace": namespace, "verb": "create", "resource": "pods"}}}
    authz = client.AuthorizationV1Api(cluster.api_client)
    poll(lambda: authz.create_subject_access_review(review).status.allowed, timeout=30,
         what=f"the RBAC authorizer to see {user}'s RoleBinding")
    return client.CoreV1Api(config.new_client_from_config(config_file=str(path)))


EDIT = "qgpu-test-edit"


def _edit_role(rbac: client.RbacAuthorizationV1Api) -> str:
    """The built-in ``edit`` ClusterRole as kube-controller-manager's aggregation controller fills
    it (the rules of every ClusterRole labelled ``aggregate-to-edit``). The test control plane runs
    no controller-manager, so the apiserver's own ``edit`` stays empty; this copy is what ``edit``
    grants in a real cluster."""
    try:
        rbac.read_cluster_role(EDIT)
        return EDIT
    except client.exceptions.ApiException as exc:
        if exc.status != 404:
            raise
    parts = rbac.list_cluster_role(label_selector="rbac.authorization.k8s.io/aggregate-to-edit=true").items
    rules = [client.ApiClient().sanitize_for_serialization(rule) for part in parts for rule in part.rules or []]
    assert any("pods" in (r.get("resources") or []) and "create" in r["verbs"] for r in rules), rules
    rbac.create_cluster_role({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                              "metadata": {"name": EDIT}, "rules": rules})
    return EDIT


def wait_pod_policies_lifted(api: Any, namespace: str, timeout: float = 60.0) -> None:
    """After a module deleted the rendered admission policies: the apiserver drops a deleted policy
    a moment later (its informer), and until then the next module's admin writes of qgpu.io/ pod
    annotations are still refused. Probe with such a pod in ``namespace`` until one is admitted."""
    import time

    from kubernetes.client.exceptions import ApiException

    name = "policies-lifted-probe"
    probe = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": name, "namespace": namespace, "annotations": {"qgpu.io/allocation": "probe"}},
             "spec": {"schedulerName": "qgpu-test-nobody", "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}
    deadline = time.monotonic() + timeout
    while True:
        try:
            api.create_namespaced_pod(namespace, probe)
        except ApiException as exc:
            if exc.status == 409:  # an earlier probe still there: remove it and ask again
                api.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            elif exc.status != 403:
                raise
            elif time.monotonic() > deadline:  # said here, not as the next module's unexplained refusals
                raise AssertionError(f"the deleted admission policies still refuse qgpu.io/ pod annotations "
                                     f"after {timeout:.0f} s: {exc.body}") from exc
            time.sleep(0.5)
            continue
        try:
            api.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except ApiException:
            pass
        return


def wait_policies_enforced(probes: dict[str, Any], timeout: float = 30.0) -> None:
    """Admission policies reach the apiserver's admission chain through informers, each policy and
    binding on its own. ``probes``: policy name -> a dry-run write that RBAC allows and only that
    policy refuses; each is polled until it is refused with qgpu's message (any other error is
    raised), within ``timeout`` for them all."""
    import time

    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + timeout
    for policy, probe in probes.items():
        while True:
            try:
                probe()
            except ApiException as exc:
                if exc.status == 403 and "qgpu" in (exc.body or ""):
                    break
                raise
            if time.monotonic() > deadline:
                raise AssertionError(f"admission policy {policy} was not enforced within {timeout:g} s")
            time.sleep(0.3)
