"""`pdserve slo` and `pdserve scale`: change a running app's SLO, pins and bounds in Redis.

The Serve autoscaling policies read them within about a second (autoscaling/
control_reader.py), so no redeploy is needed. The app and its Redis come from the local run
(`pdserve up`), or from --redis-url (or PDSERVE_REDIS_URL) and --app on a cluster.

    pdserve slo get
    pdserve slo set [--ttft-p95 500ms] [--tpot-p95 60ms]
    pdserve scale prefill|decode N        pin N replicas (clamped into the bounds)
    pdserve scale prefill|decode auto     release the pin: scale on the SLO again
    pdserve scale prefill|decode --min A --max B
    pdserve role                          which replicas take the other pool's calls
    pdserve role REPLICA prefill|decode   flip: REPLICA takes that pool's calls (router/roles.py)
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import redis

from control.keys import POOLS, REDIS_URL_ENV
from control.sync_store import SyncControlStore
from router.roles import LIVE_ACK_S


class Target(NamedTuple):
    redis_url: str
    app: str

    def store(self) -> SyncControlStore:
        return SyncControlStore.connect(self.redis_url, self.app)


def add_operator_commands(commands: argparse._SubParsersAction) -> None:
    """Add `slo` and `scale` to the `pdserve` subcommands."""
    slo = commands.add_parser("slo", help="show or set the latency SLO the pools scale on")
    slo_actions = slo.add_subparsers(dest="slo_command", required=True, metavar="ACTION")
    get = slo_actions.add_parser("get", help="show the SLO stored for the app")
    _add_target_flags(get)
    get.set_defaults(func=cmd_slo_get)
    set_ = slo_actions.add_parser("set", help="set the TTFT and/or TPOT P95 target")
    set_.add_argument("--ttft-p95", type=duration_arg, metavar="DURATION", help="e.g. 500ms, 2s")
    set_.add_argument("--tpot-p95", type=duration_arg, metavar="DURATION", help="e.g. 60ms")
    _add_target_flags(set_)
    set_.set_defaults(func=cmd_slo_set)

    scale = commands.add_parser(
        "scale", help="pin a pool's replicas (N), release the pin (auto), or set its bounds"
    )
    scale.add_argument("pool", choices=POOLS)
    scale.add_argument("replicas", nargs="?", metavar="N|auto", help="replicas to pin, or auto")
    scale.add_argument("--min", dest="min_replicas", type=int, help="lower bound (with --max)")
    scale.add_argument("--max", dest="max_replicas", type=int, help="upper bound (with --min)")
    _add_target_flags(scale)
    scale.set_defaults(func=cmd_scale)

    role = commands.add_parser(
        "role",
        help="flip a replica to the other pool's calls (no restart), or list the flips",
    )
    role.add_argument("replica", nargs="?", help="a replica id as `pdserve status` lists it")
    role.add_argument("role", nargs="?", choices=POOLS, help="the pool whose calls it takes")
    role.add_argument(
        "--timeout",
        type=duration_arg,
        default=5.0,
        metavar="DURATION",
        help="how long to wait for every router to apply the flip (default 5s)",
    )
    _add_target_flags(role)
    role.set_defaults(func=cmd_role)


def cmd_slo_get(args: argparse.Namespace) -> int:
    def run(target: Target) -> str:
        with target.store() as store:
            slo = store.get_slo()
        if slo is None:
            return f"{target.app}: no SLO set; the pools use their configured defaults"
        return f"{target.app}: SLO TTFT P95 {_fmt(slo.ttft_p95_s)}, TPOT P95 {_fmt(slo.tpot_p95_s)}"

    return _run(args, run)


def cmd_slo_set(args: argparse.Namespace) -> int:
    def run(target: Target) -> str:
        with target.store() as store:
            slo = store.set_slo(args.ttft_p95, args.tpot_p95)
        return (
            f"{target.app}: SLO set to TTFT P95 {_fmt(slo.ttft_p95_s)}, "
            f"TPOT P95 {_fmt(slo.tpot_p95_s)} (the autoscalers apply it within a second)"
        )

    return _run(args, run)


def cmd_scale(args: argparse.Namespace) -> int:
    def run(target: Target) -> str:
        app, pool = target.app, args.pool
        has_bounds = args.min_replicas is not None or args.max_replicas is not None
        if args.replicas is None and not has_bounds:
            raise ValueError("give N, auto, or --min A --max B")
        if has_bounds and (args.min_replicas is None or args.max_replicas is None):
            raise ValueError("--min and --max go together")
        lines = []
        bounds = None
        with target.store() as store:
            if has_bounds:  # First, so a pin given with them is judged against the new bounds.
                bounds = store.set_bounds(pool, args.min_replicas, args.max_replicas)
                lines.append(
                    f"{app}: {pool} bounded to [{bounds.min_replicas}, {bounds.max_replicas}]"
                )
            if args.replicas == "auto":
                had_pin = store.unpin(pool)
                lines.append(
                    f"{app}: {pool} scales on its SLO" + ("" if had_pin else " (it was not pinned)")
                )
            elif args.replicas is not None:
                num_replicas = _replica_count(args.replicas)
                store.pin(pool, num_replicas)
                bounds = bounds or store.get_bounds(pool)
                clamped = bounds.clamp(num_replicas) if bounds is not None else num_replicas
                note = f", clamped to {clamped} by its bounds" if clamped != num_replicas else ""
                lines.append(f"{app}: {pool} pinned to {num_replicas} replicas{note}")
        return "\n".join(lines)

    return _run(args, run)


class Flip(NamedTuple):
    version: int
    # From the write until every router that was live had applied it.
    seconds: float
    num_routers: int


def flip_role(
    store: SyncControlStore,
    worker_id: str,
    role: str,
    timeout_s: float = 5.0,
    poll_s: float = 0.005,
) -> Flip:
    """Flip `worker_id` to `role`'s calls and wait until every router that acked the roles
    within LIVE_ACK_S has applied it; TimeoutError names those that did not in `timeout_s`."""
    now = time.time()
    live = {r for r, a in store.roles_applied().items() if now - a.at <= LIVE_ACK_S}
    started = time.perf_counter()
    version = store.flip(worker_id, role)
    while True:
        applied = store.roles_applied()
        behind = sorted(r for r in live if r not in applied or applied[r].version < version)
        elapsed = time.perf_counter() - started
        if not behind:
            return Flip(version, elapsed, len(live))
        if elapsed > timeout_s:
            raise TimeoutError(
                f"routers {', '.join(behind)} did not apply roles version {version} within "
                f"{_fmt(timeout_s)}; the flip is stored and applies when they read it"
            )
        time.sleep(poll_s)


def cmd_role(args: argparse.Namespace) -> int:
    def run(target: Target) -> str:
        with target.store() as store:
            if args.replica is None:
                table = store.role_table()
                if not table.flipped:
                    return f"{target.app}: every replica takes its own pool's calls"
                flips = (f"  {w} takes {r} calls" for w, r in sorted(table.flipped.items()))
                return "\n".join([f"{target.app}: roles version {table.version}", *flips])
            if args.role is None:
                raise ValueError("give the role too: pdserve role REPLICA prefill|decode")
            flip = flip_role(store, args.replica, args.role, args.timeout)
        routers = f"{flip.num_routers} router{'s' if flip.num_routers != 1 else ''}"
        return (
            f"{target.app}: {args.replica} takes {args.role} calls (roles version "
            f"{flip.version}; applied by {routers} in {flip.seconds * 1000:.0f} ms)"
        )

    return _run(args, run)


def resolve_target(args: argparse.Namespace) -> Target:
    """Flags and PDSERVE_REDIS_URL first, then the local run's state file."""
    url = args.redis_url or os.environ.get(REDIS_URL_ENV)
    app = args.app
    if url is None or app is None:
        from deploy.local import load_run

        run = load_run()
        if run is not None:
            url = url or run.redis_url
            app = app or run.app
    if url is None:
        raise ValueError(f"no local run (pdserve up); give --redis-url or set {REDIS_URL_ENV}")
    if app is None:
        raise ValueError("no local run (pdserve up); give --app")
    return Target(url, app)


def _run(args: argparse.Namespace, action: Callable[[Target], str]) -> int:
    """Run `action` and print its confirmation; a bad input or an unreachable Redis is one line
    on stderr and exit code 2."""
    try:
        print(action(resolve_target(args)))
    except (ValueError, TimeoutError, redis.RedisError, OSError) as error:
        print(f"pdserve: error: {error}", file=sys.stderr)
        return 2
    return 0


def _add_target_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url", help=f"control-plane Redis (default: ${REDIS_URL_ENV}, else the local run)"
    )
    parser.add_argument("--app", help="app name (default: the local run's)")


def duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)\s*")


def parse_duration(text: str) -> float:
    """Seconds in "500ms", "0.5s", "2s" or "1m". A unit is required: a bare "500" could mean
    milliseconds or seconds, and guessing wrong sets an SLO a thousand times off."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(
            f"duration must be a number with a unit ms, s or m (e.g. 500ms, 0.5s, 1m), got {text!r}"
        )
    value, unit = float(match.group(1)), match.group(2)
    # Divide for ms: 300 / 1000 is exactly 0.3, 300 * 0.001 is not.
    seconds = value / 1000 if unit == "ms" else value * 60 if unit == "m" else value
    if not math.isfinite(seconds):
        raise ValueError(f"duration is out of range: {text!r}")
    return seconds


def _replica_count(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"N must be a replica count >= 0 or 'auto', got {text!r}")
    return int(text)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:g} ms" if seconds < 1 else f"{seconds:g} s"
