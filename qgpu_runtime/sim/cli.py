"""`qgpu simulate`: replay a GPU cluster trace through the placement engine and report packing."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from qgpu_runtime.contract.cliflags import int_within
from qgpu_runtime.contract.inventory import MAX_MEMORY_MIB
from qgpu_runtime.placement.engine import CardChoice
from qgpu_runtime.placement.policies import POLICIES
from qgpu_runtime.sim.preemption import ARMS, MixError, PreemptionResult, PriorityMix, replay_preemption
from qgpu_runtime.sim.replay import ReplayOptions, SeedResult, replay_arrivals, replay_times
from qgpu_runtime.sim.trace import TraceError, load_nodes, load_pods
from qgpu_runtime.sim.variants import PRODUCTION_FRACTION, VariantError, with_demand_share, with_gpu_spec

DEFAULT_SEEDS = "42-51"
MAX_SEEDS = 1000
"""Seeds of one run: a seed of the bundled trace replays in seconds, so 1,000 is hours of work;
the list is built before any replay, and ``--seeds 0-100000000`` took all memory building it."""
MAX_WORKERS = 256
"""Worker processes: each holds the trace and a cluster state; more than there are replays never
start (one per replay at most)."""


MAX_SEED = 2**63 - 1
"""Seeds of the replay and of the variants' and priorities' draws: any int64 (what a JSON reader
keeps exactly); a 5,000-digit seed is not a seed but a typo."""
MAX_GPU_MEMORY_MIB = MAX_MEMORY_MIB
"""--gpu-memory: what one sharing pod asks of one card, at most the largest card the inventory
keeps (1 TiB)."""


seed_value = int_within(0, MAX_SEED, "a seed")
"""An argparse ``type`` for a seed option (argparse names the option)."""


class UsageError(ValueError):
    """A bad option value; printed as one line with exit code 2."""


def parse_seeds(text: str) -> list[int]:
    """'42-51' or '42,43,50' or '7'; at most :data:`MAX_SEEDS` of them, counted before any is listed."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part), int(part))
        except ValueError:
            raise UsageError(f"--seeds: {part[:32]!r} is not a seed or a range like 42-51") from None
        if hi < lo:
            raise UsageError(f"--seeds: range {part[:32]!r} runs backwards")
        if lo < 0 or hi > MAX_SEED:
            raise UsageError(f"--seeds: {part[:32]!r}: seeds must be within 0..{MAX_SEED}")
        if len(seeds) + hi - lo + 1 > MAX_SEEDS:
            raise UsageError(f"--seeds: {text[:64]!r} names more than {MAX_SEEDS} seeds")
        seeds.extend(range(lo, hi + 1))
    if not seeds:
        raise UsageError("--seeds: no seeds given")
    return seeds


def worker_count(requested: int, jobs: int) -> int:
    """Processes for ``jobs`` replays: ``requested`` (0: one per CPU), never more than the replays."""
    if not 0 <= requested <= MAX_WORKERS:
        raise UsageError(f"--workers: {requested} must be between 0 and {MAX_WORKERS} (0: one per CPU)")
    return max(1, min(requested or os.cpu_count() or 1, jobs))


def plot_problem(path: Path) -> None:
    """--plot must name a file in a folder that exists, checked before the replays run (a plot
    that cannot be written used to end a finished replay with a traceback)."""
    if path.is_dir():
        raise UsageError(f"--plot {path}: is a directory; name the PNG file to write")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"--plot {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--plot {path}: folder {parent} is not writable")


def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise UsageError(f"--policy: {', '.join(unknown) or 'empty'} unknown; choose from {', '.join(sorted(POLICIES))}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", required=True, type=Path, help="node list CSV (sn,cpu_milli,memory_mib,gpu,model)")
    parser.add_argument("--pods", required=True, type=Path, help="pod list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,…])")
    parser.add_argument("--policy", default="frag", help="policies, comma-separated: " + ", ".join(sorted(POLICIES)))
    parser.add_argument("--seeds", default=None,
                        help=f"seeds: 42-51, or 42,43 (default {DEFAULT_SEEDS}; at most {MAX_SEEDS}, each 0..2^63-1; "
                             "--replay-times uses none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per policy, one per line")
    parser.add_argument("--plot", type=Path, help="write a PNG of unallocated GPU %% against arrived %%")
    parser.add_argument("--expected", type=Path, help="published results CSV to draw beside --plot (FGD study format)")
    parser.add_argument("--replay-times", action="store_true", help="honour creation and deletion times: pods leave")
    parser.add_argument("--gpu-memory", type=int, default=0, metavar="MIB",
                        help="GPU memory each sharing pod asks for (default 0: GPU memory left out, as in the study)")
    parser.add_argument("--pod-limit", action="store_true", help="enforce the qGPU per-card pod-count limit")
    parser.add_argument("--card-choice", choices=[c.value for c in CardChoice], default=CardChoice.POLICY.value,
                        help="who picks the cards inside the policy's node: the policy (default), or first fit in "
                             "card index order, as kube-scheduler's DRA allocator does (docs/dra.md)")
    parser.add_argument("--workers", type=int, default=0,
                        help=f"processes for seeds (default 0: one per CPU; at most {MAX_WORKERS}, never more than the replays)")
    parser.add_argument("--gpu-spec-fraction", type=float, default=None, metavar="F",
                        help="replay the GPU-model variant: about F of the GPU pods (0..1; the study's "
                             f"production share is {PRODUCTION_FRACTION:.3f}) get the model requirements "
                             "GPU pods carry in the study's production cluster (docs/simulator.md)")
    parser.add_argument("--multi-card-fraction", type=float, default=None, metavar="F",
                        help="replay a workload mix drawn from the trace in which pods asking for several whole "
                             "cards ask for about F of the GPU demand (0..1; the bundled trace: 0.073)")
    parser.add_argument("--sharing-fraction", type=float, default=None, metavar="F",
                        help="replay a workload mix drawn from the trace in which pods sharing one card ask for "
                             "about F of the GPU demand (0..1; the bundled trace: 0.285)")
    parser.add_argument("--variant-seed", type=seed_value, default=0, help="seed of the variant's draws (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--preemption", type=float, default=None, metavar="F",
                        help="replay preemption instead: each arriving pod is high-priority with probability F, "
                             "else low; kube-scheduler's node-level choice against qgpu's card-level one "
                             "(docs/extender.md, Preemption)")
    parser.add_argument("--preemption-seed", type=seed_value, default=0, help="seed of the priority draws (default 0)")


@dataclass
class PolicySummary:
    policy: str
    seeds: list[int]
    card_choice: str
    unallocated_gpu_pct_at_100: float
    unallocated_gpu_pct_at_130: float
    allocation_ratio_at_100: float
    fragmentation_pct_at_100: float
    failed_pods: float
    pods: float
    seconds: float
    curve: list[float | None]

    def to_json(self) -> dict:
        return {
            "policy": self.policy,
            "seeds": self.seeds,
            "card_choice": self.card_choice,
            "unallocated_gpu_pct_at_100": self.unallocated_gpu_pct_at_100,
            "unallocated_gpu_pct_at_130": self.unallocated_gpu_pct_at_130,
            "allocation_ratio_at_100": self.allocation_ratio_at_100,
            "fragmentation_pct_at_100": self.fragmentation_pct_at_100,
            "failed_pods": self.failed_pods,
            "pods": self.pods,
            "seconds": self.seconds,
            "unallocated_gpu_pct_by_arrived": self.curve,
        }


def _median(values: list[float]) -> float:
    clean = [v for v in values if not np.isnan(v)]
    return round(statistics.median(clean), 4) if clean else float("nan")


def summarise(policy: str, results: list[SeedResult], seconds: float, card_choice: str = CardChoice.POLICY.value) -> PolicySummary:
    curves = np.array([r.alloc_pct_by_bin for r in results])
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a bin no seed reached is NaN, shown as null
        median_curve = np.nanmedian(np.where(np.isnan(curves), np.nan, 100.0 - curves), axis=0) if len(results) else np.array([])
    return PolicySummary(
        policy=policy,
        seeds=[r.seed for r in results],
        card_choice=card_choice,
        unallocated_gpu_pct_at_100=_median([r.unallocated_at(100) for r in results]),
        unallocated_gpu_pct_at_130=_median([r.unallocated_at(min(130, len(r.alloc_pct_by_bin) - 1)) for r in results]),
        allocation_ratio_at_100=_median([float(r.alloc_pct_by_bin[100]) for r in results]),
        fragmentation_pct_at_100=_median([r.frag_pct_at_100 for r in results]),
        failed_pods=statistics.median(r.failed_pods for r in results),
        pods=statistics.median(r.pods for r in results),
        seconds=round(seconds, 2),
        curve=[None if np.isnan(v) else round(float(v), 4) for v in median_curve],
    )


class _Progress:
    """A tqdm bar on stderr, or nothing; it counts either way. ``unit`` is what one update
    counts; ``total`` None when the count is not known ahead (a seed's pods: the replay extends
    them to 130 % of capacity as they arrive)."""

    def __init__(self, total: int | None, desc: str, unit: str, enabled: bool):
        self.total, self.unit, self.count = total, unit, 0
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _one_seed(args: tuple, progress: Callable[[int], None] | None = None) -> SeedResult:
    nodes, pods, policy, seed, options = args
    start = time.perf_counter()
    result = replay_arrivals(nodes, pods, policy, seed, options, progress=progress)
    result.seconds = time.perf_counter() - start
    return result


def _run_arrivals(nodes, pods, policies: list[str], seeds: list[int], options: ReplayOptions, workers: int, progress: bool) -> list[PolicySummary]:
    summaries = []
    jobs = [(nodes, pods, p, s, options) for p in policies for s in seeds]
    by_policy: dict[str, list[SeedResult]] = {p: [] for p in policies}
    started = {p: time.perf_counter() for p in policies}
    elapsed = {p: 0.0 for p in policies}
    # One replay alone (one policy, one seed) counts its pods: a bar of one seed would sit at 0/1.
    single = len(jobs) == 1
    bar = (_Progress(None, f"{policies[0]} seed {seeds[0]}", "pod", progress) if single
           else _Progress(len(jobs), "seeds", "seed", progress))
    pool = None
    if single or workers <= 1:
        results_iter = (_one_seed(job, progress=bar.update if single else None) for job in jobs)
    else:
        pool = ProcessPoolExecutor(max_workers=workers)
        results_iter = pool.map(_one_seed, jobs)
    try:
        for result in results_iter:
            by_policy[result.policy].append(result)
            elapsed[result.policy] = time.perf_counter() - started[result.policy]
            if not single:
                bar.update()
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown()
    for p in policies:
        summaries.append(summarise(p, sorted(by_policy[p], key=lambda r: r.seed), elapsed[p], options.card_choice.value))
    return summaries


def _run_preemption(nodes, pods, policies: list[str], seeds: list[int], mix: PriorityMix, options: ReplayOptions,
                    as_json: bool, progress: bool) -> None:
    """Every arm on the same draws; one JSON line per policy, seed and arm, or a table summed over seeds."""
    bar = _Progress(len(policies) * len(seeds) * len(ARMS), "replays", "replay", progress)
    totals: dict[tuple[str, str], list[PreemptionResult]] = {}
    for policy in policies:
        for seed in seeds:
            for arm in ARMS:
                result = replay_preemption(nodes, pods, policy, seed, mix, arm, options)
                totals.setdefault((policy, arm), []).append(result)
                if as_json:
                    print(json.dumps(result.to_json()), flush=True)
                bar.update()
    bar.close()
    if as_json:
        return
    print(f"{'policy':<8} {'arm':<9} {'high pods':>9} {'placed':>7} {'by preemption':>13} {'pending':>8} "
          f"{'evicted':>8} {'per admission':>13} {'wasted':>7}")
    for (policy, arm), results in totals.items():
        sums = [sum(getattr(r, f) for r in results) for f in
                ("high_pods", "high_placed", "high_preempted_in", "high_pending", "evicted", "wasted")]
        per = f"{sums[4] / sums[2]:.2f}" if sums[2] else "-"
        print(f"{policy:<8} {arm:<9} {sums[0]:>9} {sums[1]:>7} {sums[2]:>13} {sums[3]:>8} {sums[4]:>8} {per:>13} {sums[5]:>7}")
    print(f"(summed over seeds {','.join(map(str, seeds))}; high-priority share {mix.high_fraction}, draws seeded "
          f"{mix.seed}; node: kube-scheduler's own choice over node totals; extender: its candidate nodes, qgpu's "
          "victims; card: every node weighed at card level)")


def _table(summaries: list[PolicySummary]) -> str:
    head = f"{'policy':<10} {'unalloc@100%':>13} {'unalloc@130%':>13} {'frag@100%':>10} {'failed pods':>12} {'seconds':>8}"
    lines = [head]
    for s in summaries:
        lines.append(f"{s.policy:<10} {s.unallocated_gpu_pct_at_100:>13.2f} {s.unallocated_gpu_pct_at_130:>13.2f} "
                     f"{s.fragmentation_pct_at_100:>10.2f} {s.failed_pods:>12.0f} {s.seconds:>8.1f}")
    lines.append("(unalloc = % of cluster GPU capacity left unallocated, median over seeds, at arrived demand 100% / 130%)")
    if summaries and summaries[0].card_choice != CardChoice.POLICY.value:
        lines.append(f"(cards inside each node chosen {summaries[0].card_choice}, as kube-scheduler's DRA allocator does)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        policies = parse_policies(args.policy)
        seeds = parse_seeds(DEFAULT_SEEDS if args.seeds is None else args.seeds)
        workers = worker_count(args.workers, len(seeds) * len(policies))
        if not 0 <= args.gpu_memory <= MAX_GPU_MEMORY_MIB:
            raise UsageError(f"--gpu-memory: {args.gpu_memory} must be within 0..{MAX_GPU_MEMORY_MIB} (MiB of one card; "
                             "0 leaves GPU memory out)")
        if args.expected is not None and args.plot is None:
            raise UsageError(f"--expected {args.expected}: only with --plot (the published results are drawn beside the plot)")
        if args.plot is not None:
            plot_problem(args.plot)
        if progress:  # a large trace takes seconds to read; say so rather than sit silent
            print(f"qgpu simulate: reading {args.nodes} and {args.pods}", file=sys.stderr, flush=True)
        nodes = load_nodes(args.nodes)
        pods = load_pods(args.pods)
        if args.multi_card_fraction is not None and args.sharing_fraction is not None:
            raise UsageError("--multi-card-fraction and --sharing-fraction: give one of them, not both")
        if args.multi_card_fraction is not None:
            pods = with_demand_share(pods, "multi", args.multi_card_fraction, args.variant_seed)
        if args.sharing_fraction is not None:
            pods = with_demand_share(pods, "sharing", args.sharing_fraction, args.variant_seed)
        if args.gpu_spec_fraction is not None:
            pods = with_gpu_spec(pods, nodes, args.gpu_spec_fraction, args.variant_seed)
        mix = PriorityMix(args.preemption, args.preemption_seed) if args.preemption is not None else None
        if mix is not None and (args.replay_times or args.plot):
            raise UsageError(f"--preemption and {'--replay-times' if args.replay_times else '--plot'}: the preemption "
                             "replay arrives pods in the study's order and draws no curve; give one of them")
        if args.replay_times and args.seeds is not None:
            raise UsageError(f"--seeds {args.seeds[:32]!r} and --replay-times: the time-ordered replay uses no seeds "
                             "(pods arrive at their creation_time); give one of them")
    except (UsageError, TraceError, VariantError, MixError) as exc:
        print(f"qgpu simulate: {exc}", file=sys.stderr)
        return 2
    options = ReplayOptions(gpu_memory_mib=args.gpu_memory, pod_limit=args.pod_limit, card_choice=CardChoice(args.card_choice))
    if mix is not None:
        _run_preemption(nodes, pods, policies, seeds, mix, options, args.json, progress)
        return 0
    if args.replay_times:
        try:
            for policy in policies:
                bar = _Progress(len(pods), policy, "pod", progress)
                result = replay_times(nodes, pods, policy, options, progress=bar.update)
                bar.close()
                row = {"policy": policy, "mode": "replay-times", "pods": result.pods, "failed_pods": result.failed_pods,
                       "failed_gpu_milli": result.failed_gpu_milli, "mean_allocation_pct": result.mean_alloc_pct,
                       "peak_allocation_pct": result.peak_alloc_pct}
                print(json.dumps(row) if args.json else
                      f"{policy:<10} mean allocation {result.mean_alloc_pct:6.2f}%  peak {result.peak_alloc_pct:6.2f}%  "
                      f"failed pods {result.failed_pods}")
        except ValueError as exc:
            print(f"qgpu simulate: {exc}", file=sys.stderr)
            return 2
        return 0
    summaries = _run_arrivals(nodes, pods, policies, seeds, options, workers, progress)
    if args.json:
        for s in summaries:
            print(json.dumps(s.to_json()))
    else:
        print(_table(summaries))
    if args.plot:
        from qgpu_runtime.sim.plot import plot_curves

        expected = args.expected or args.nodes.resolve().parent.parent / "fgd-expected-results" / "default_allocation_by_arrival.csv"
        plot_curves(summaries, args.plot, expected)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
