"""One benchmark run: every system in turn, each through every workload and offered load, into
one report. The same seeds give every system the same prompts; each offered load gets prompts
of its own, so no load is served from the prefix cache of the one before (but the shared
prefix of `shared-prefix` stays shared, as a system prompt does)."""

from __future__ import annotations

import asyncio
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import Report, Run, markdown
from bench.runner import Arrival, run_load, warm_up
from bench.stats import SLO
from bench.targets import Target
from bench.workload import build_requests
from deploy.workload import Workload


@dataclass(frozen=True)
class BenchPlan:
    workloads: Sequence[Workload]
    arrivals: Sequence[Arrival] | None = None  # None: each workload's own rates
    num_requests: int | None = None  # None: each workload's own count
    slo: SLO | None = None  # None: each workload's own SLO
    dollars_per_hour: float = 1.0
    attainment_target: float = 0.9
    num_warmup: int = 2
    seed: int = 0
    progress: bool = True

    def arrivals_of(self, workload: Workload) -> list[tuple[Arrival, int]]:
        """(arrival, number of requests) in the order they run: by default the workload's
        one-at-a-time run (the low-load overhead), then its sweep of rates."""
        if self.arrivals is not None:
            return [(a, self.num_requests or workload.num_requests) for a in self.arrivals]
        n = self.num_requests or workload.num_requests
        low = (
            [(Arrival("closed", 1), workload.low_load_requests)]
            if workload.low_load_requests
            else []
        )
        return low + [(Arrival("poisson", rate), n) for rate in workload.rates]

    def slo_of(self, workload: Workload) -> SLO:
        return self.slo or SLO(workload.slo.ttft_s, workload.slo.tpot_s, workload.slo.itl_s)


async def measure(target: Target, plan: BenchPlan, tokenizer: Any) -> list[Run]:
    runs = []
    try:
        for workload in plan.workloads:
            if plan.num_warmup:
                warm = build_requests(workload, tokenizer, plan.num_warmup, seed=plan.seed - 1)
                await warm_up(target, warm)
            for number, (arrival, n) in enumerate(plan.arrivals_of(workload)):
                seed = plan.seed + 1000 * (number + 1)
                requests = build_requests(workload, tokenizer, n, seed=seed, prefix_seed=plan.seed)
                records = await run_load(target, requests, arrival, seed, plan.progress)
                run = Run(
                    target.name, workload.name, arrival, records, plan.slo_of(workload),
                    plan.dollars_per_hour,
                )  # fmt: skip
                runs.append(run)
                print(_one_line(run), file=sys.stderr)
    finally:
        await target.close()
    return runs


def run_benchmark(
    plan: BenchPlan,
    systems: Sequence[Callable[[], AbstractContextManager[Target]]],
    tokenizer: Any,
    out_dir: Path,
    meta: dict[str, Any],
) -> tuple[Report, list[Path]]:
    """Start each system, measure it, stop it; the report is saved after every system (so a
    crash keeps what was measured). Returns the report and the files of the last save."""
    report = Report({**machine_facts(), **meta}, attainment_target=plan.attainment_target)
    paths: list[Path] = []
    for start in systems:
        started = time.perf_counter()
        with start() as target:
            print(
                f"[bench] {target.name} is up in {time.perf_counter() - started:.0f} s",
                file=sys.stderr,
            )
            report.runs += asyncio.run(measure(target, plan, tokenizer))
        # Filled as the system stopped (bench/systems.py: role flips).
        if facts := getattr(target, "facts", None):
            report.meta.setdefault("facts", {})[target.name] = facts
        paths = write_report(report, out_dir)
    return report, paths


def write_report(report: Report, out_dir: Path) -> list[Path]:
    from bench.plots import plot_report

    report.save(out_dir / "report.json")
    (out_dir / "report.md").write_text(markdown(report))
    return [out_dir / "report.json", out_dir / "report.md", *plot_report(report, out_dir)]


def machine_facts() -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cores": cores,
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "commit": commit,
    }


def _cpu_model() -> str:
    """The processor's name as /proc/cpuinfo gives it (hosts differ: AVX2 only, or AMX)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _one_line(run: Run) -> str:
    s = run.summary
    ttft = "-" if s.ttft is None else f"{s.ttft.p50 * 1e3:.0f}/{s.ttft.p95 * 1e3:.0f}"
    tpot = "-" if s.tpot is None else f"{s.tpot.p50 * 1e3:.0f}/{s.tpot.p95 * 1e3:.0f}"
    return (
        f"[bench] {run.system} {run.workload} {run.arrival.label}: {s.num_completed}/{s.num_sent} "
        f"done, TTFT P50/P95 {ttft} ms, TPOT P50/P95 {tpot} ms, SLO met {s.slo_attainment:.0%}"
    )
