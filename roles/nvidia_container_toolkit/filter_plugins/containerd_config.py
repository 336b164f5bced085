"""Filters that build the containerd drop-in holding the nvidia runtime.

Why Python and not a Jinja template: the drop-in depends on what the node's main config already
says, and containerd merges imported files differently by major version:

- containerd 1.x (config schema 2) merges an imported file into the main config one top-level
  plugin table at a time: a drop-in with a `[plugins."io.containerd.grpc.v1.cri"...]` table
  REPLACES the main config's whole CRI section (sandbox image, registry config_path, CNI dirs,
  restrict_oom_score_adj, the runc runtime...). So the schema-2 drop-in carries a copy of the
  main config's CRI table with the nvidia runtime merged into it.
- containerd 2.x (schema 3) merges imports deeply and migrates each file on its own, so the
  schema-3 drop-in holds only the nvidia runtime under `io.containerd.cri.v1.runtime`.

The controller parses the main config with tomllib (ansible-core 2.19 needs Python >= 3.11 on the
controller) and writes TOML with a small emitter; both are unit-tested against real containerd
(tests/provisioning/test_containerd_dropin.py).
"""

from __future__ import annotations

import copy
import json
import math
import re
import tomllib
from typing import Any

from ansible.errors import AnsibleFilterError

CRI_PLUGIN = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def containerd_parse(text: str, path: str = "config.toml", host: str = "") -> dict[str, Any]:
    """The main config as a dict; an error names the host, the file and the parser's complaint."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise AnsibleFilterError(f"{host}: {path} is not valid TOML ({err}); containerd would refuse it too") from err


def containerd_nvidia_dropin(main: dict[str, Any], schema: int, binary: str, systemd_cgroup: bool,
                             default_runtime: bool, path: str = "config.toml", host: str = "") -> dict[str, Any]:
    """The drop-in (as data) that adds the nvidia runtime and keeps every setting of `main`."""
    schema = int(schema)
    if schema not in CRI_PLUGIN:
        raise AnsibleFilterError(f"{host}: containerd config schema {schema} is not supported (2: containerd 1.x, 3: 2.x)")
    main_version = int(main.get("version", 1))
    # containerd 2.x migrates every file to schema 3 on its own; containerd 1.x reads schema 1 or 2,
    # but a schema-1 main config names the CRI plugin "cri", which a schema-2 drop-in cannot extend.
    if schema == 2 and main_version != 2:
        raise AnsibleFilterError(
            f"{host}: {path} has version = {main_version} but nvidia_container_toolkit_containerd_config_version is 2; "
            "containerd 1.x merges a schema-2 drop-in only into a version 2 main config (run `containerd config "
            "migrate` or write version = 2), or set the schema to 3 for containerd 2.x")

    runtime: dict[str, Any] = {
        "runtime_type": "io.containerd.runc.v2",
        "privileged_without_host_devices": False,
        "options": {"BinaryName": binary, "SystemdCgroup": bool(systemd_cgroup)},
    }
    nvidia: dict[str, Any] = {"containerd": {"runtimes": {"nvidia": runtime}}}
    if default_runtime:
        nvidia["containerd"]["default_runtime_name"] = "nvidia"

    plugin = CRI_PLUGIN[schema]
    if schema == 2:
        kept = copy.deepcopy(main.get("plugins", {}).get(plugin, {}))
        section = deep_merge(kept, nvidia)
    else:
        section = nvidia
    return {"version": schema, "plugins": {plugin: section}}


def containerd_imports(main: dict[str, Any], glob: str) -> list[str]:
    """The main config's imports with the drop-in glob added once (other imports stay)."""
    imports = list(main.get("imports", []))
    return imports if glob in imports else [*imports, glob]


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`base` with `update` merged in, tables merged key by key, other values replaced."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def to_toml(data: dict[str, Any]) -> str:
    """TOML text of `data` (tables, arrays of tables, strings, numbers, booleans, arrays)."""
    lines: list[str] = []
    _emit_table(data, [], lines)
    return "\n".join(lines).strip() + "\n"


def _emit_table(table: dict[str, Any], path: list[str], lines: list[str]) -> None:
    tables = {k: v for k, v in table.items() if isinstance(v, dict)}
    arrays_of_tables = {k: v for k, v in table.items() if _is_array_of_tables(v)}
    scalars = {k: v for k, v in table.items() if k not in tables and k not in arrays_of_tables}
    # A table that only holds tables needs no header of its own (TOML defines it implicitly).
    if path and (scalars or not (tables or arrays_of_tables)):
        lines.extend(["", f"[{'.'.join(_key(p) for p in path)}]"])
    lines.extend(f"{'  ' if path else ''}{_key(k)} = {_value(v)}" for k, v in scalars.items())
    for key, sub in tables.items():
        _emit_table(sub, [*path, key], lines)
    for key, items in arrays_of_tables.items():
        for item in items:
            lines.extend(["", f"[[{'.'.join(_key(p) for p in [*path, key])}]]"])
            lines.extend(f"  {_key(k)} = {_value(v)}" for k, v in item.items())


def _is_array_of_tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    raise AnsibleFilterError(f"cannot write {value!r} ({type(value).__name__}) as TOML")


class FilterModule:
    """nvidia_container_toolkit filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "containerd_parse": containerd_parse,
            "containerd_nvidia_dropin": containerd_nvidia_dropin,
            "containerd_imports": containerd_imports,
            "containerd_to_toml": to_toml,
        }
