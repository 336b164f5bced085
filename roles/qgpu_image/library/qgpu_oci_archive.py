#!/usr/bin/python
"""Ansible module: write a single-layer OCI image archive from directory trees, deterministically."""

from __future__ import annotations

DOCUMENTATION = r"""
module: qgpu_oci_archive
short_description: Write a single-layer OCI image archive (an OCI image layout in a tar) from directory trees
description:
  - Merges directory trees (later trees win on the same path) into one gzip layer, adds generated
    console scripts and a non-root user, and writes an OCI image layout (oci-layout, index.json,
    blobs) as one tar that C(ctr images import) and C(skopeo copy oci-archive:) accept.
  - Deterministic. Entries are sorted, every mtime is O(created), owners are numeric only (no
    user or group names, so the build host's /etc/passwd cannot leak in), gzip carries no name or
    time. The same trees and options give the same manifest digest.
  - Idempotent. The archive's sidecar C(<dest>.json) records O(inputs_key) and the digests; when the
    key matches and the archive exists, nothing is rewritten (changed=false) and the recorded
    digests are returned.
options:
  dest: {description: Path of the archive to write., type: path, required: true}
  reference: {description: Full image reference, named in index.json for containerd and the OCI ref.name tag., type: str, required: true}
  inputs_key: {description: Fingerprint of every input (the caller's); a different key rewrites the archive., type: str, required: true}
  trees:
    description: Directories copied into the layer, in order. C(owner=keep) keeps numeric uid/gid, C(root) writes 0/0.
    type: list
    elements: dict
    required: true
  exclude: {description: fnmatch patterns of image paths (no leading slash) left out of the layer., type: list, elements: str, default: []}
  console_scripts: {description: "{src: host directory of an installed tree (pip --target), interpreter: the image's python, bin_dir: image directory}: write a script for each [console_scripts] entry of every *.dist-info in src.", type: dict}
  user: {description: "{name, uid, gid, home}: appended to etc/passwd and etc/group of the merged trees, home created.", type: dict}
  config: {description: "Image config: env, cmd, entrypoint, working_dir, user, labels.", type: dict, default: {}}
  architecture: {description: GOARCH of the image., type: str, default: amd64}
  created: {description: Seconds since the epoch used for every mtime and the config's created time., type: int, default: 0}
"""

import configparser
import fnmatch
import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ansible.module_utils.basic import AnsibleModule

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
# containerd names imported images from this annotation (the OCI one carries only the tag).
CONTAINERD_NAME = "io.containerd.image.name"
OCI_REF_NAME = "org.opencontainers.image.ref.name"


class ArchiveError(Exception):
    """A bad input, with the offending value in the message."""


@dataclass(frozen=True)
class Entry:
    """One layer member: from a host path (stat'ed when written) or generated content."""

    source: str | None
    owner: str = "keep"
    content: bytes | None = None
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    directory: bool = False


class HashingWriter:
    """A write-only file object that hashes and counts what passes through to `target`."""

    def __init__(self, target: IO[bytes]) -> None:
        self.target = target
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.target.write(data)

    def flush(self) -> None:
        self.target.flush()

    def tell(self) -> int:
        return self.size

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha256.hexdigest()


def image_path(path: str) -> str:
    return path.strip("/")


def collect(trees: list[dict[str, Any]], exclude: list[str]) -> dict[str, Entry]:
    """Map image path -> Entry over every tree; later trees replace earlier entries on a path."""
    entries: dict[str, Entry] = {}
    for tree in trees:
        src = Path(tree["src"])
        if not src.is_dir():
            raise ArchiveError(f"tree src {str(src)!r} is not a directory")
        owner = tree.get("owner", "keep")
        if owner not in ("keep", "root"):
            raise ArchiveError(f"tree owner {owner!r} for {str(src)!r}: must be 'keep' or 'root'")
        dest = image_path(tree.get("dest", "/"))
        parts = dest.split("/") if dest else []
        for depth in range(1, len(parts) + 1):  # parents of a tree mounted below the root
            entries.setdefault("/".join(parts[:depth]), Entry(None, directory=True, mode=0o755))
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            rel = os.path.relpath(dirpath, src)
            for name in [*dirnames, *sorted(filenames)]:
                member = "/".join(p for p in (dest, "" if rel == "." else rel, name) if p)
                if any(fnmatch.fnmatchcase(member, pattern) for pattern in exclude):
                    continue
                entries[member] = Entry(os.path.join(dirpath, name), owner=owner)
            if rel == "." and dest:
                entries[dest] = Entry(str(src), owner=owner)
    # An excluded directory's children are left out with it.
    return {path: entry for path, entry in entries.items()
            if not any(fnmatch.fnmatchcase(parent, pattern) for parent in parents(path) for pattern in exclude)}


def parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def read_entry(entries: dict[str, Entry], path: str) -> str:
    entry = entries.get(path)
    if entry is None:
        raise ArchiveError(f"the merged trees have no /{path}: cannot add the image user")
    if entry.content is not None:
        return entry.content.decode()
    return Path(entry.source).read_text(encoding="utf-8")


def add_user(entries: dict[str, Entry], user: dict[str, Any]) -> None:
    """Append the user and its group to etc/passwd and etc/group, and create its home."""
    name, uid, gid, home = user["name"], int(user["uid"]), int(user["gid"]), user["home"]
    passwd = [line for line in read_entry(entries, "etc/passwd").splitlines() if line]
    group = [line for line in read_entry(entries, "etc/group").splitlines() if line]
    for line in passwd:
        fields = line.split(":")
        if fields[0] != name and fields[2] == str(uid):
            raise ArchiveError(f"uid {uid} for user {name!r} is already taken by {fields[0]!r} in the base's /etc/passwd")
    for line in group:
        fields = line.split(":")
        if fields[0] != name and fields[2] == str(gid):
            raise ArchiveError(f"gid {gid} for group {name!r} is already taken by {fields[0]!r} in the base's /etc/group")
    passwd = [line for line in passwd if line.split(":")[0] != name]
    group = [line for line in group if line.split(":")[0] != name]
    passwd.append(f"{name}:x:{uid}:{gid}::{home}:/usr/sbin/nologin")
    group.append(f"{name}:x:{gid}:")
    entries["etc/passwd"] = Entry(None, content=("\n".join(passwd) + "\n").encode(), mode=0o644)
    entries["etc/group"] = Entry(None, content=("\n".join(group) + "\n").encode(), mode=0o644)
    entries[image_path(home)] = Entry(None, directory=True, mode=0o755, uid=uid, gid=gid)


def add_console_scripts(entries: dict[str, Entry], spec: dict[str, Any]) -> list[str]:
    """pip --target writes scripts with the build host's interpreter in the shebang, so the
    image's scripts are written here, for the image's own interpreter."""
    written = []
    for dist_info in sorted(Path(spec["src"]).glob("*.dist-info")):
        points = dist_info / "entry_points.txt"
        if not points.exists():
            continue
        parser = configparser.ConfigParser(delimiters=("=",))
        parser.optionxform = str  # script names are case-sensitive
        parser.read(points, encoding="utf-8")
        if not parser.has_section("console_scripts"):
            continue
        for script, target in sorted(parser.items("console_scripts")):
            module, _, attr = target.strip().partition(":")
            body = (f"#!{spec['interpreter']}\nimport sys\nfrom {module.strip()} import {attr.strip()}\n"
                    f"if __name__ == \"__main__\":\n    sys.exit({attr.strip()}())\n")
            path = image_path(spec["bin_dir"]) + "/" + script
            entries[path] = Entry(None, content=body.encode(), mode=0o755)
            written.append("/" + path)
    if not written:
        raise ArchiveError(f"no [console_scripts] in any *.dist-info under {spec['src']!r}")
    return written


def tar_info(tar: tarfile.TarFile, path: str, entry: Entry, mtime: int) -> tuple[tarfile.TarInfo | None, IO[bytes] | None]:
    """The member's header (None for what tar cannot hold: sockets) and its data, if a file."""
    if entry.source is None:
        info = tarfile.TarInfo(path)
        info.uid, info.gid, info.mode = entry.uid, entry.gid, entry.mode
        if entry.directory:
            info.type = tarfile.DIRTYPE
            data = None
        else:
            info.size = len(entry.content or b"")
            data = io.BytesIO(entry.content or b"")
    else:
        info = tar.gettarinfo(entry.source, arcname=path)
        if info is None:  # sockets and the like
            return None, None
        if entry.owner == "root":
            info.uid = info.gid = 0
        data = open(entry.source, "rb") if info.isreg() else None
    info.mtime = mtime
    info.uname = info.gname = ""
    return info, data


def write_layer(entries: dict[str, Entry], out: IO[bytes], mtime: int) -> tuple[str, str, int]:
    """Write the gzip layer to `out`; return (diff_id, blob digest, blob size)."""
    blob = HashingWriter(out)
    with gzip.GzipFile(filename="", mode="wb", fileobj=blob, compresslevel=6, mtime=0) as zipped:
        raw = HashingWriter(zipped)
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted(entries):
                info, data = tar_info(tar, path, entries[path], mtime)
                if info is None:
                    continue
                try:
                    tar.addfile(info, data)
                finally:
                    if data is not None:
                        data.close()
    return raw.digest, blob.digest, blob.size


def canonical(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def descriptor(media_type: str, data: bytes) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data)}


def image_config(params: dict[str, Any], diff_id: str) -> dict[str, Any]:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(params["created"]))
    wanted = params["config"] or {}
    config: dict[str, Any] = {}
    for key, field in (("user", "User"), ("env", "Env"), ("entrypoint", "Entrypoint"), ("cmd", "Cmd"),
                       ("working_dir", "WorkingDir"), ("labels", "Labels")):
        if wanted.get(key):
            config[field] = wanted[key]
    return {"created": created, "architecture": params["architecture"], "os": "linux", "config": config,
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created": created, "created_by": "qgpu_image role (qgpu_oci_archive)"}]}


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes | None, mtime: int, source: str | None = None) -> None:
    info = tarfile.TarInfo(name)
    info.mtime, info.mode, info.uname, info.gname = mtime, 0o644, "", ""
    if source is not None:
        info.size = os.path.getsize(source)
        with open(source, "rb") as handle:
            tar.addfile(info, handle)
    elif data is None:
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
    else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def build(params: dict[str, Any]) -> dict[str, Any]:
    dest = Path(params["dest"])
    dest.parent.mkdir(parents=True, exist_ok=True)
    entries = collect(params["trees"], params["exclude"])
    scripts = add_console_scripts(entries, params["console_scripts"]) if params.get("console_scripts") else []
    if params.get("user"):
        add_user(entries, params["user"])
    mtime = params["created"]
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".layer-") as scratch:
        layer_path = os.path.join(scratch, "layer.tar.gz")
        with open(layer_path, "wb") as out:
            diff_id, layer_digest, layer_size = write_layer(entries, out, mtime)
        config = canonical(image_config(params, diff_id))
        config_desc = descriptor(MEDIA_CONFIG, config)
        layer_desc = {"mediaType": MEDIA_LAYER, "digest": layer_digest, "size": layer_size}
        manifest = canonical({"schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "config": config_desc,
                              "layers": [layer_desc]})
        manifest_desc = descriptor(MEDIA_MANIFEST, manifest)
        tag = params["reference"].rsplit(":", 1)[1] if ":" in params["reference"].rsplit("/", 1)[-1] else "latest"
        index = canonical({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [{
            **manifest_desc,
            "annotations": {CONTAINERD_NAME: params["reference"], OCI_REF_NAME: tag},
            "platform": {"architecture": params["architecture"], "os": "linux"}}]})
        partial = os.path.join(scratch, "image.tar")
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            add_bytes(tar, "blobs", None, mtime)
            add_bytes(tar, "blobs/sha256", None, mtime)
            blobs = {manifest_desc["digest"]: (manifest, None), config_desc["digest"]: (config, None),
                     layer_digest: (None, layer_path)}
            for digest in sorted(blobs):
                data, source = blobs[digest]
                add_bytes(tar, "blobs/sha256/" + digest.split(":", 1)[1], data, mtime, source)
            add_bytes(tar, "index.json", index, mtime)
            add_bytes(tar, "oci-layout", canonical({"imageLayoutVersion": "1.0.0"}), mtime)
        os.replace(partial, dest)
    record = {"inputs_key": params["inputs_key"], "reference": params["reference"],
              "manifest_digest": manifest_desc["digest"], "config_digest": config_desc["digest"],
              "layer_digest": layer_digest, "diff_id": diff_id, "layer_size": layer_size,
              "archive_size": dest.stat().st_size, "console_scripts": scripts}
    sidecar = Path(str(dest) + ".json")
    sidecar.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return record


def recorded(params: dict[str, Any]) -> dict[str, Any] | None:
    sidecar = Path(params["dest"] + ".json")
    if not (sidecar.exists() and os.path.exists(params["dest"])):
        return None
    record = json.loads(sidecar.read_text(encoding="utf-8"))
    if record.get("inputs_key") != params["inputs_key"] or record.get("reference") != params["reference"]:
        return None
    if record.get("archive_size") != os.path.getsize(params["dest"]):
        return None
    return record


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "dest": {"type": "path", "required": True},
            "reference": {"type": "str", "required": True},
            "inputs_key": {"type": "str", "required": True},
            "trees": {"type": "list", "elements": "dict", "required": True},
            "exclude": {"type": "list", "elements": "str", "default": []},
            "console_scripts": {"type": "dict"},
            "user": {"type": "dict"},
            "config": {"type": "dict", "default": {}},
            "architecture": {"type": "str", "default": "amd64"},
            "created": {"type": "int", "default": 0},
        },
        supports_check_mode=True,
    )
    params = module.params
    record = recorded(params)
    if record is not None:
        module.exit_json(changed=False, archive=params["dest"], **record)
    if module.check_mode:
        module.exit_json(changed=True, archive=params["dest"])
    try:
        record = build(params)
    except (ArchiveError, OSError) as error:
        module.fail_json(msg=f"qgpu_oci_archive: {error}")
    module.exit_json(changed=True, archive=params["dest"], **record)


if __name__ == "__main__":
    main()
