"""A rebuilt image under the same reference rolls qgpu's pods: each role puts the image's manifest
digest (qgpu_image_digest, which site.yml takes from the image it built) into its pod template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_dra_prioritize_roles import render_scheduler
from test_dra_roles import MIXED_MODES, by_kind, render_manager
from test_webhook_dra_render import render

from qgpu_runtime.contract.names import IMAGE_DIGEST

DIGEST = "sha256:" + "5e" * 32
ANNOTATION = IMAGE_DIGEST


def templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The pod templates' annotations of every DaemonSet and Deployment, by name."""
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"].get("annotations") or {}
            for d in docs if d["kind"] in ("DaemonSet", "Deployment")}


@pytest.mark.parametrize("digest", [DIGEST, ""])
def test_every_pod_template_carries_the_images_digest_when_it_is_known(tmp_path: Path, digest: str) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "s").mkdir()
    run, manager = render_manager(tmp_path / "m", MIXED_MODES, qgpu_image_digest=digest)
    assert run.returncode == 0, run.output[-4000:]
    scheduler = render_scheduler(tmp_path / "s", MIXED_MODES, qgpu_image_digest=digest)
    webhook = render(tmp_path / "w", "device-plugin", qgpu_image_digest=digest)
    found = {**templates(manager), **templates(scheduler), **templates(webhook)}
    assert set(by_kind(manager, "DaemonSet")) <= set(found) and "qgpu-scheduler" in found and "qgpu-webhook" in found
    for name, notes in found.items():
        assert notes.get(ANNOTATION) == (digest or None), name


def containers(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["image"]
            for d in docs if d["kind"] in ("DaemonSet", "Deployment")}


def test_a_pushed_image_is_named_by_its_digest(tmp_path: Path) -> None:
    """A registry's image under a reused tag: with IfNotPresent a node that holds the tag from an
    earlier build kept running that one, whatever the annotation rolled. Named by digest it pulls."""
    (tmp_path / "m").mkdir()
    (tmp_path / "s").mkdir()
    built = containers(render(tmp_path / "w0", "device-plugin"))["qgpu-webhook"]  # every role's default image
    pinned = {"qgpu_image_digest": DIGEST, "qgpu_image_by_digest": True, "qgpu_image_built_reference": built}
    run, manager = render_manager(tmp_path / "m", MIXED_MODES, **pinned)
    assert run.returncode == 0, run.output[-4000:]
    found = {**containers(manager), **containers(render_scheduler(tmp_path / "s", MIXED_MODES, **pinned)),
             **containers(render(tmp_path / "w", "device-plugin", **pinned))}
    assert "qgpu-scheduler" in found and "qgpu-webhook" in found
    assert all(image.endswith("@" + DIGEST) and ":" in image.split("@")[0] for image in found.values()), found
    # imported images (no registry) keep the tag: each node's containerd holds the new build under it
    webhook = render(tmp_path / "w2", "device-plugin", qgpu_image_digest=DIGEST)
    assert "@" not in containers(webhook)["qgpu-webhook"]
    # a component given another image (or one already named by digest) is not given the build's digest
    for image in ("registry.example/other:2", "registry.example/qgpu@sha256:" + "a1" * 32):
        webhook = render(tmp_path / f"w-{len(image)}", "device-plugin", qgpu_webhook_image=image, **pinned)
        assert containers(webhook)["qgpu-webhook"] == image
