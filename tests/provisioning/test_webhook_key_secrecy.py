"""The webhook's serving key never reaches Ansible's output: not with --diff (a template's diff is
the whole rendered file, and the manifest carries the Secret), not with -v (results are printed).

The role runs for real (PKI, rendering) on localhost under a temporary root; the key it created is
then searched for, in PEM and in the base64 the Secret carries, in everything ansible-playbook said.
"""

from __future__ import annotations

import base64
from pathlib import Path

import yaml
from ansible_tools import REPO, ansible_playbook
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

TASKS = REPO / "roles" / "qgpu_webhook" / "tasks"


def key_fragments(pem: str) -> list[str]:
    """What would betray the key: each base64 line of the PEM body, the Secret's base64 of the whole
    PEM (cut in pieces, as a diff or a wrapped line may split it), and the private number in hex.
    An EC key's PEM ends with its public point, which the crypto modules rightly report: pieces
    found in the public key are not secrets."""
    key = serialization.load_pem_private_key(pem.encode(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    body = [line for line in pem.splitlines() if line and not line.startswith("-----")]
    encoded = base64.b64encode(pem.encode()).decode()
    fragments = body + [encoded[i:i + 40] for i in range(0, len(encoded) - 40, 40)]
    return [f for f in fragments if f not in public] + [format(key.private_numbers().private_value, "064x")]


def test_rendering_with_diff_and_verbose_output_shows_no_key_material(tmp_path: Path) -> None:
    playbook = tmp_path / "render.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Render the webhook", "hosts": "all", "gather_facts": False,
        "vars": {"ansible_python_interpreter": "{{ ansible_playbook_python }}", "qgpu_root_prefix": str(tmp_path / "root")},
        "tasks": [{"name": "Render without applying", "ansible.builtin.include_role": {"name": "qgpu_webhook"},
                   "vars": {"qgpu_webhook_apply": False}}],
    }]))
    outputs = []
    for _ in range(2):  # the first run creates the files, the second finds them: both with --diff
        run = ansible_playbook("-i", "localhost,", "-c", "local", "--diff", "-v", str(playbook))
        assert run.returncode == 0, run.output[-4000:]
        outputs.append(run.output)
    key = (tmp_path / "root" / "etc" / "qgpu" / "pki" / "webhook" / "tls.key").read_text()
    manifest = (tmp_path / "root" / "etc" / "qgpu" / "manifests" / "qgpu-webhook.yaml").read_text()
    assert base64.b64encode(key.encode()).decode() in manifest  # the key really is in what was rendered
    for output in outputs:
        leaks = [fragment for fragment in key_fragments(key) if fragment in output]
        assert leaks == [], f"serving key material in ansible-playbook output: {leaks[:3]}"


def flatten(tasks: list[dict]) -> list[dict]:
    """Tasks, with those inside blocks (block, rescue, always) in their place."""
    out: list[dict] = []
    for task in tasks:
        if "block" in task:
            for part in ("block", "rescue", "always"):
                out += flatten(task.get(part) or [])
        else:
            out.append(task)
    return out


def test_every_task_touching_the_key_or_the_manifest_hides_its_diff_and_result() -> None:
    """The apply (k8s returns the applied Secret; with --diff it shows it) cannot run here without an
    apiserver (tests/provisioning/test_k8s_half.py applies it): the tasks are read instead."""
    secret_files = ("tls.key", "ca.key", "qgpu-webhook.yaml")
    touching = []
    for path in sorted(TASKS.glob("*.yml")):
        for task in flatten(yaml.safe_load(path.read_text()) or []):
            module = next((k for k in task if "." in k), "")
            args = task.get(module) or {}
            files = [str(args.get(k, "")) for k in ("path", "src", "dest")] if isinstance(args, dict) else []
            writes_or_reads = any(f.endswith(secret_files) for f in files) or any(
                str(item).endswith(secret_files) for item in task.get("loop") or [])
            carries = module == "ansible.builtin.set_fact" and "qgpu_webhook_tls_key" in yaml.safe_dump(args)
            if writes_or_reads or carries:
                touching.append((path.name, task))
    names = [task["name"] for _, task in touching]
    assert any("Apply" in n for n in names) and any("Render" in n for n in names), names
    for file, task in touching:
        assert task.get("diff") is False, f"{file}: {task['name']!r}: needs diff: false"
        module = next(k for k in task if "." in k)
        if module in ("kubernetes.core.k8s", "ansible.builtin.slurp", "ansible.builtin.set_fact"):
            assert task.get("no_log") is True, f"{file}: {task['name']!r}: returns key material, needs no_log: true"
