"""`python -m autoscaling.sim.report`: our policy vs the queue-length baseline, same trace.

Prints a markdown table and the command that produced it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from autoscaling.sim.baseline import queue_length_policies
from autoscaling.sim.pool_policies import slo_policies
from autoscaling.sim.profiles import PROFILES
from autoscaling.sim.results import SimResult
from autoscaling.sim.simulator import SimSettings, simulate
from autoscaling.sim.trace import ArrivalTrace, LengthRange, bursty_trace
from control.records import PoolSLO, ReplicaBounds


def build_trace(args: argparse.Namespace) -> ArrivalTrace:
    return bursty_trace(
        base_rate_per_s=args.base_rate,
        peak_factor=args.peak_factor,
        low_s=args.phase_s,
        high_s=args.phase_s,
        num_cycles=args.cycles,
        prompt_tokens=LengthRange(args.prompt_min, args.prompt_max),
        output_tokens=LengthRange(args.output_min, args.output_max),
        seed=args.seed,
    )


def table(results: Sequence[SimResult]) -> str:
    rows = [
        "| policy | SLO attainment | goodput (req/s) | prefill replica-s | decode replica-s "
        "| scale events (P/D) | TTFT P95 (s) | TPOT P95 (ms) | peak replicas (P/D) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ttft, tpot = r.ttft_p(), r.tpot_p()
        rows.append(
            f"| {r.policy_name} | {r.slo_attainment:.1%} | {r.goodput_per_s:.3f} "
            f"| {r.prefill_replica_s:,.0f} | {r.decode_replica_s:,.0f} "
            f"| {r.num_events('prefill')} / {r.num_events('decode')} "
            f"| {ttft if ttft is None else f'{ttft:.2f}'} "
            f"| {tpot if tpot is None else f'{tpot * 1e3:.0f}'} "
            f"| {r.peak_prefill_replicas} / {r.peak_decode_replicas} |"
        )
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m autoscaling.sim.report")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu-fp32-1core")
    parser.add_argument("--ttft-slo", type=float, default=5.0, help="TTFT P95 SLO, seconds")
    parser.add_argument("--tpot-slo", type=float, default=0.2, help="TPOT P95 SLO, seconds")
    parser.add_argument("--base-rate", type=float, default=0.4, help="requests/s at 1x")
    parser.add_argument("--peak-factor", type=float, default=10.0)
    parser.add_argument("--phase-s", type=float, default=600.0, help="length of each phase")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--prompt-min", type=int, default=128)
    parser.add_argument("--prompt-max", type=int, default=1024)
    parser.add_argument("--output-min", type=int, default=32)
    parser.add_argument("--output-max", type=int, default=256)
    parser.add_argument("--max-replicas", type=int, default=64, help="per pool")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    slo = PoolSLO(ttft_p95_s=args.ttft_slo, tpot_p95_s=args.tpot_slo)
    bounds = ReplicaBounds(1, args.max_replicas)
    settings = SimSettings(profile=PROFILES[args.profile], slo=slo)
    trace = build_trace(args)
    started = time.perf_counter()
    results = [
        simulate(trace, slo_policies(slo, bounds, bounds), settings),
        simulate(
            trace, queue_length_policies(prefill_bounds=bounds, decode_bounds=bounds), settings
        ),
    ]
    elapsed = time.perf_counter() - started
    command = " ".join(["python -m autoscaling.sim.report", *(argv or sys.argv[1:])])
    print(
        f"Profile `{args.profile}`, SLO TTFT P95 {args.ttft_slo:g} s / TPOT P95 "
        f"{args.tpot_slo * 1e3:g} ms, {results[0].num_arrived} requests over "
        f"{trace.duration_s:,.0f} s (rate {args.base_rate:g} <-> "
        f"{args.base_rate * args.peak_factor:g} req/s, phases of {args.phase_s:g} s), "
        f"seed {args.seed}; both runs simulated in {elapsed:.1f} s.\n"
    )
    print(table(results))
    print(f"\nCommand: `{command}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
