"""``qgpu run --core 30 --memory 5 [--class online|offline] [--wait] -- CMD ARGS…``

Books a share of a local card through the placement engine (state in SQLite), runs CMD with that
card and quota, and releases the booking when CMD ends, however it ends. A job that does not fit
fails at once with the placement engine's reason, or waits for room with ``--wait``.

Exit status: CMD's own (128 + N when a signal N ended it); 2 for a bad request or setup; 75 when
the job does not fit and ``--wait`` was not given (or its ``--wait-timeout`` ran out); 69 when no
card of the host could ever hold it (``--wait`` does not wait for that).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sqlite3
import sys
import time

from qgpu_runtime.contract.cliflags import printable_problem
from qgpu_runtime.contract.largestcard import add_largest_card_argument, card_limits
from qgpu_runtime.isolation.policy import parse_policy
from qgpu_runtime.model import AppClass
from qgpu_runtime.placement import Unschedulable
from qgpu_runtime.standalone.booking import JobRequestError, JobSpec, NeverFits, new_job_id, try_book
from qgpu_runtime.standalone.config import HostConfig, discover_cards
from qgpu_runtime.standalone.dbfile import ensure_private, resolve
from qgpu_runtime.standalone.store import JobRecord, Store, StoreError, job_processes, process_start_ticks, session_members, unusable, unwritable
from qgpu_runtime.standalone.supervisor import job_environment, supervise

# the same file `qgpu manager serve` uses by default, so a plain `--standalone` host needs no flags
DEFAULT_DB = os.environ.get("QGPU_STANDALONE_DB", "/var/lib/qgpu/meta.db")
EXIT_USAGE = 2
EXIT_NO_FIT = 75  # EX_TEMPFAIL: try again later
EXIT_NEVER_FITS = 69  # EX_UNAVAILABLE: this host cannot serve the request at all


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--core", type=int, help="percent of one card's compute (100 = a whole card, 200 = two)")
    parser.add_argument("--memory", type=int, help="GiB of GPU memory on each card")
    parser.add_argument("--class", dest="klass", choices=[c.value for c in AppClass], default=AppClass.NORMAL.value,
                        help="online jobs reserve memory only and get priority; offline jobs use only what online ones leave")
    parser.add_argument("--name", help="job name shown by qgpu status (default: the command's name)")
    parser.add_argument("--wait", action="store_true", help="wait for room instead of failing when the job does not fit")
    parser.add_argument("--wait-timeout", type=float, help="with --wait: give up after this many seconds")
    parser.add_argument("--dbfile", default=DEFAULT_DB, help=f"standalone state database (default {DEFAULT_DB}, or $QGPU_STANDALONE_DB)")
    parser.add_argument("--gpu-backend", choices=("nvml", "simulated"),
                        help="only when no manager has recorded the host's cards yet: where to find them")
    parser.add_argument("--simulated-gpus", metavar="SPEC", help="with --gpu-backend simulated, e.g. 2xT4-16G")
    add_largest_card_argument(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS…")


MAX_WAIT_TIMEOUT_S = 7 * 24 * 3600.0


def wait_timeout_problem(args: argparse.Namespace) -> str | None:
    """Why ``--wait-timeout`` is refused, or None: it must be finite, above 0, at most a week, and
    comes with ``--wait`` (alone it would be silently ignored)."""
    timeout = args.wait_timeout
    if timeout is None:
        return None
    if not math.isfinite(timeout) or not 0 < timeout <= MAX_WAIT_TIMEOUT_S:
        return f"--wait-timeout {timeout:g}: must be seconds above 0 and at most {MAX_WAIT_TIMEOUT_S:.0f} (a week)"
    if not args.wait:
        return f"--wait-timeout {timeout:g}: only with --wait (without it a job that does not fit fails at once)"
    return None


def name_problem(name: str | None) -> str | None:
    """Why ``--name`` is refused, or None: it is one column of `qgpu status`."""
    return None if name is None else printable_problem("--name", name)


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"qgpu run: {message}", file=sys.stderr)
    return code


def host_config(store: Store, args: argparse.Namespace) -> HostConfig:
    """The settings the manager recorded; a run never overrides the node's policy."""
    policy = parse_policy(store.get_meta("policy") or "best-effort", field=f"policy recorded in {store.path}")
    node = store.get_meta("node") or os.uname().nodename
    backend = store.get_meta("gpu_backend") or args.gpu_backend or "nvml"
    return HostConfig(node_name=node, policy=policy, placement=store.get_meta("placement") or "binpack",
                      gpu_backend=backend, simulated_gpus=store.get_meta("simulated_gpus") or args.simulated_gpus)


def ensure_cards(store: Store, args: argparse.Namespace) -> None:
    if store.cards():
        return
    if not args.gpu_backend:
        raise StoreError(f"--dbfile {store.path!r}: no cards recorded: start `qgpu manager serve --standalone --dbfile {store.path}` "
                         "first, or pass --gpu-backend nvml (or simulated with --simulated-gpus)")
    config = HostConfig(node_name=os.uname().nodename, gpu_backend=args.gpu_backend, simulated_gpus=args.simulated_gpus)
    store.set_cards(discover_cards(config))
    with store.transaction():
        for key, value in (("node", config.node_name), ("policy", config.policy.value),
                           ("gpu_backend", config.gpu_backend), ("simulated_gpus", config.simulated_gpus or "")):
            if store.get_meta(key) is None:
                store.set_meta(key, value)


def _mps_settings(store: Store) -> dict[str, str] | None:
    pipe = store.get_meta("mps_pipe_dir")
    if not pipe:
        return None
    return {"pipe_dir": pipe, "log_dir": store.get_meta("mps_log_dir") or pipe, "pinned": store.get_meta("mps_pinned") or "0"}


def _left_behind(job: JobRecord, leader: dict[str, int]) -> list[int]:
    """PIDs of the job's processes still alive after its command (the session leader) ended."""
    if not leader:
        return []
    running = dataclasses.replace(job, pgid=leader["pgid"], pgid_start=leader["pgid_start"])
    return [p.pid for p in job_processes(running, session_members())]


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return _fail("missing the command to run: qgpu run --core 30 --memory 5 -- CMD ARGS…")
    problem = wait_timeout_problem(args) or name_problem(args.name)
    if problem:
        return _fail(problem)
    klass = AppClass(args.klass)
    try:
        limits = card_limits(args.largest_card_memory_mib)
    except ValueError as err:
        return _fail(str(err))
    spec = JobSpec(args.name or os.path.basename(command[0]), args.core, args.memory, klass, limits)
    dbfile = resolve(args.dbfile)  # one file from here on (dbfile.py): a link swapped later is not followed
    try:
        refused = unwritable(dbfile)
        if refused:
            raise StoreError(refused)
        # The job's devices, MPS pipe and environment come from this file's rows: only a file and
        # directory of this user (or root) that no one else may write are believed (dbfile.py),
        # and one created here is private.
        ensure_private(dbfile)
        store = Store(dbfile)
        ensure_cards(store, args)
        config = host_config(store, args)
    except (StoreError, ValueError, RuntimeError) as err:
        return _fail(str(err))
    except sqlite3.Error as err:
        return _fail(unusable(dbfile, err))

    me, my_start = os.getpid(), process_start_ticks(os.getpid()) or 0
    job_id = new_job_id(spec.name)
    deadline = None if args.wait_timeout is None else time.monotonic() + args.wait_timeout
    delay, told = 0.2, False
    while True:
        try:
            job = try_book(store, config, spec, job_id, shlex.join(command), me, my_start, time.time())
            break
        except JobRequestError as err:
            return _fail(str(err))
        except sqlite3.Error as err:
            store.close()
            return _fail(unusable(store.path, err))
        except NeverFits as err:
            return _fail(f"job {spec.name!r} can never fit on this host: {err}", EXIT_NEVER_FITS)
        except Unschedulable as err:
            reasons = "; ".join(f"{node}: {why}" for node, why in sorted(err.reasons.items()))
            if not args.wait:
                return _fail(f"job {spec.name!r} does not fit now ({reasons}); use --wait to wait for room", EXIT_NO_FIT)
            if deadline is not None and time.monotonic() >= deadline:
                return _fail(f"job {spec.name!r} still does not fit after {args.wait_timeout:g}s ({reasons})", EXIT_NO_FIT)
            if not told:
                print(f"qgpu run: waiting for room for job {spec.name!r} ({reasons})", file=sys.stderr)
                told = True
            time.sleep(delay)
            delay = min(2.0, delay * 1.5)

    cards = ", ".join(f"card {s.index} ({s.core_milli / 10:g}% / {s.memory_mib} MiB)" for s in job.shares)
    print(f"qgpu run: job {job.id} on {cards}, policy {config.policy.value}", file=sys.stderr)
    env = job_environment(os.environ, job, config.policy, _mps_settings(store))

    leader: dict[str, int] = {}

    def started(pid: int) -> None:
        # not yet waited for, so readable even if the command already ended (a quick `sh -c 'x &'`)
        leader.update(pgid=pid, pgid_start=process_start_ticks(pid, exited_too=True) or 0)
        with store.transaction():
            store.set_job_process(job.id, pid, leader["pgid_start"])

    def release() -> None:
        left = _left_behind(job, leader)
        if left:
            # the booking stays with them: the next reader reaps it once the last one exits
            pids = " ".join(str(p) for p in sorted(left)[:5]) + (" …" if len(left) > 5 else "")
            print(f"qgpu run: job {job.id}: its command ended but {len(left)} of its processes still run "
                  f"(pid {pids}); the booking stays until they exit", file=sys.stderr)
        else:
            store.delete_job(job.id)
        for event in store.events(job.id):
            print(f"qgpu run: job {job.id}: {event.reason}: {event.message}", file=sys.stderr)

    try:
        return supervise(command, env, started, release)
    finally:
        store.close()

