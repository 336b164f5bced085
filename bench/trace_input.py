"""The trace a replay benchmark reads, and the workload mix drawn from it, from the command line:
``--nodes``/``--pods`` (default: the bundled openb trace, found as the tests find it) and, as
`qgpu simulate` draws them, ``--multi-card-fraction`` or ``--sharing-fraction`` with
``--variant-seed``."""

from __future__ import annotations

import argparse
from pathlib import Path

from qgpu_runtime.placement.state import NodeSpec
from qgpu_runtime.sim.trace import TracePod, load_nodes, load_pods
from qgpu_runtime.sim.variants import with_demand_share
from tests.tracedata import openb_trace_dir


def add_trace_arguments(parser: argparse.ArgumentParser, sharing: bool = True) -> None:
    """The trace's and the mix's options (``sharing``: offer ``--sharing-fraction`` too)."""
    parser.add_argument("--nodes", type=Path, help="node list CSV (default: the bundled trace's, found as the tests find it)")
    parser.add_argument("--pods", type=Path, help="pod list CSV (default: the bundled trace's default list)")
    mix = parser.add_mutually_exclusive_group()
    mix.add_argument("--multi-card-fraction", type=float, help="replay this multi-card mix (as `qgpu simulate`)")
    if sharing:
        mix.add_argument("--sharing-fraction", type=float, help="replay this card-sharing mix (as `qgpu simulate`)")
    parser.add_argument("--variant-seed", type=int, default=0, help="which draw of the mix (as `qgpu simulate`)")


def load_trace(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[NodeSpec], list[TracePod]]:
    """The nodes and the pods (the mix drawn, when one is asked for); a missing bundled trace is a
    usage error."""
    if args.nodes is None or args.pods is None:
        data = openb_trace_dir()
        if data is None:
            parser.error("the bundled trace was not found ($QGPU_TRACE_DIR, ../shared/data/gpu-trace-v2023 or "
                         "/work/shared/data/gpu-trace-v2023): set QGPU_TRACE_DIR or give --nodes and --pods")
        args.nodes = args.nodes or data / "openb_node_list_gpu_node.csv"
        args.pods = args.pods or data / "openb_pod_list_default.csv"
    nodes = load_nodes(args.nodes)
    pods = load_pods(args.pods)
    if args.multi_card_fraction is not None:
        pods = with_demand_share(pods, "multi", args.multi_card_fraction, args.variant_seed)
    elif getattr(args, "sharing_fraction", None) is not None:
        pods = with_demand_share(pods, "sharing", args.sharing_fraction, args.variant_seed)
    return nodes, pods
