"""The node manager's --largest-card-memory-mib: the limits it builds are the cluster's (the same
flag and rule as the webhook's and the extender's), and a card of this node larger than them is
one warning at start, never a failure."""

from __future__ import annotations

import argparse
import logging

import pytest

from qgpu_runtime import manager_cmd
from qgpu_runtime.contract.largestcard import card_limits
from qgpu_runtime.gpu.simulated import SimulatedBackend, build_cards, parse_spec
from qgpu_runtime.node import cli as node_cli
from qgpu_runtime.node.deviceplugin.resources import DEFAULT_RESOURCES, parse_resources
from qgpu_runtime.node.manager import ManagerConfig, NodeManager
from qgpu_runtime.node.pods import FilePodSource
from qgpu_runtime.node.store import Store

NODE = "gpu-node-1"
H200_MIB = 143771


def serve_args(tmp_path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    manager_cmd.add_arguments(parser)
    pods = tmp_path / "pods.json"
    pods.write_text('{"items": []}')
    return parser.parse_args(["serve", "--nodename", NODE, "--dbfile", str(tmp_path / "meta.db"), "--gpu-backend", "simulated",
                              "--simulated-gpus", f"1xH200-{H200_MIB}M", "--pods-file", str(pods), *flags])


@pytest.mark.parametrize("flags, largest", [((), 80 * 1024), (("--largest-card-memory-mib", str(H200_MIB)), H200_MIB)])
def test_the_flag_reaches_the_managers_limits(tmp_path, flags, largest):
    assert node_cli._config(serve_args(tmp_path, *flags)).limits.max_card_memory_mib == largest


def test_a_value_out_of_bounds_stops_the_manager_with_one_line_naming_it(tmp_path, caplog):
    args = serve_args(tmp_path, "--largest-card-memory-mib", "0")
    with caplog.at_level(logging.ERROR), pytest.raises(node_cli._Exit) as info:
        node_cli._open(args, logging.getLogger("qgpu.manager"))
    assert info.value.code == 2
    assert caplog.messages == ["--largest-card-memory-mib 0: must be within 1024..1048576 (MiB, a card of 1 GiB to 1 TiB)"]


def test_the_standalone_manager_refuses_the_flag_it_would_ignore(tmp_path):
    """It parses no pod: `qgpu run --largest-card-memory-mib` is where a standalone host sets it."""
    args = serve_args(tmp_path, "--standalone", "--largest-card-memory-mib", str(H200_MIB))
    assert "--largest-card-memory-mib" in manager_cmd.foreign_options(args)


def manager(tmp_path, spec: str, limits_flag: int | None) -> NodeManager:
    pods = tmp_path / "pods.json"
    pods.write_text('{"items": []}')
    config = ManagerConfig(node=NODE, resources=parse_resources(",".join(DEFAULT_RESOURCES)), plugin_dir=tmp_path / "dp",
                           state_dir=tmp_path / "state", limits=card_limits(limits_flag))
    return NodeManager(config, SimulatedBackend(build_cards(parse_spec(spec), NODE)), Store(tmp_path / "meta.db"),
                       FilePodSource(pods))


def test_a_card_larger_than_the_limit_is_one_warning_naming_it_and_the_flag(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="qgpu_runtime.node.manager"):
        m = manager(tmp_path, f"2xH200-{H200_MIB}M,1xT4-16G", None)
    m.store.close()
    (record,) = [r for r in caplog.records if "--largest-card-memory-mib" in r.getMessage()]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    for card in m.cards.values():
        assert (f"card {card.index} ({card.model}, {card.uuid}) has {H200_MIB} MiB" in message) == (card.memory_mib == H200_MIB)
    assert "the cluster admits, 81920 MiB (--largest-card-memory-mib)" in message
    assert f"set --largest-card-memory-mib {H200_MIB} on every component" in message


def test_no_warning_once_the_limit_holds_the_cards(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="qgpu_runtime.node.manager"):
        m = manager(tmp_path, f"1xH200-{H200_MIB}M", H200_MIB)
    m.store.close()
    assert not [r for r in caplog.records if "--largest-card-memory-mib" in r.getMessage()]
