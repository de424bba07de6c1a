"""`pdserve bench compare`: the ratios a reader wants from a report, per workload:

- overhead at low load: TTFT and TPOT of `disaggregated` over the bare `engine`, one request at
  a time (else at the lowest offered rate both ran); P50 and P95, above 1 means pdserve is slower;
- goodput: the max offered rate meeting the SLOs of `disaggregated` over `colocated` (above 1
  means disaggregation serves more within the SLOs).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.report import Report, Run
from bench.stats import Distribution


@dataclass(frozen=True)
class Ratio:
    what: str
    ours: float | None
    baseline: float | None

    @property
    def ratio(self) -> float | None:
        if self.ours is None or self.baseline is None or self.baseline == 0:
            return None
        return self.ours / self.baseline


@dataclass(frozen=True)
class Comparison:
    workload: str
    low_load: str | None  # the arrival the overhead ratios come from
    ratios: list[Ratio]


def compare(
    report: Report, ours: str = "disaggregated", floor: str = "engine", peer: str = "colocated"
) -> list[Comparison]:
    comparisons = []
    for workload in report.workloads:
        ratios: list[Ratio] = []
        low = _low_load(report.runs_of(workload, ours), report.runs_of(workload, floor))
        if low is not None:
            a, c = (s.summary for s in low)
            for metric in ("ttft", "tpot"):
                for q in ("p50", "p95"):
                    ratios.append(
                        Ratio(
                            f"{metric.upper()} {q.upper()} {ours} / {floor}",
                            _get(getattr(a, metric), q),
                            _get(getattr(c, metric), q),
                        )
                    )
        if report.runs_of(workload, ours) and report.runs_of(workload, peer):
            ratios.append(
                Ratio(
                    f"goodput (max req/s meeting the SLO) {ours} / {peer}",
                    report.max_rate_meeting_slo(workload, ours),
                    report.max_rate_meeting_slo(workload, peer),
                )
            )
        label = low[0].arrival.label if low is not None else None
        comparisons.append(Comparison(workload, label, ratios))
    return comparisons


def _low_load(ours: list[Run], floor: list[Run]) -> tuple[Run, Run] | None:
    """The two runs at the lowest load both measured: one request at a time if both ran it,
    else the lowest common offered rate."""
    for kind in ("closed", "poisson"):
        theirs = {r.arrival.value: r for r in floor if r.arrival.kind == kind}
        common = sorted(
            (
                (r.arrival.value, r)
                for r in ours
                if r.arrival.kind == kind and r.arrival.value in theirs
            ),
            key=lambda pair: pair[0],
        )
        if common:
            value, run = common[0]
            return run, theirs[value]
    return None


def _get(d: Distribution | None, q: str) -> float | None:
    return None if d is None else float(getattr(d, q))


def format_comparisons(comparisons: list[Comparison]) -> str:
    lines = []
    for c in comparisons:
        lines.append(f"{c.workload}" + (f" (overhead at {c.low_load})" if c.low_load else ""))
        if not c.ratios:
            lines.append("  no ratios: they need runs of disaggregated beside engine or colocated")
        for r in c.ratios:
            unit = "req/s" if r.what.startswith("goodput") else "ms"
            scale = 1.0 if unit == "req/s" else 1e3

            def show(value: float | None, scale: float = scale, unit: str = unit) -> str:
                return "n/a" if value is None else f"{value * scale:.4g} {unit}"

            ratio = "n/a" if r.ratio is None else f"{r.ratio:.2f}x"
            lines.append(f"  {r.what}: {show(r.ours)} vs {show(r.baseline)} = {ratio}")
    return "\n".join(lines)


# Issue 15's fidelity bounds: the sim's P50 within 10% of the real engine's, its P95 within 20%.
FIDELITY_BOUNDS = {"p50": 0.10, "p95": 0.20}


@dataclass(frozen=True)
class FidelityRow:
    """One load point of one workload: a latency quantile of the sim run against the real one."""

    workload: str
    load: str
    metric: str  # "TTFT" or "TPOT"
    quantile: str  # "p50" or "p95"
    real: float | None
    sim: float | None

    @property
    def error(self) -> float | None:
        """(sim - real) / real: negative when the sim is faster."""
        if self.real is None or self.sim is None or self.real == 0:
            return None
        return (self.sim - self.real) / self.real

    @property
    def within(self) -> bool:
        return self.error is not None and abs(self.error) <= FIDELITY_BOUNDS[self.quantile]


def fidelity(report: Report, sim: str = "sim", real: str = "disaggregated") -> list[FidelityRow]:
    """Every load point both systems ran, per workload: TTFT and TPOT, P50 and P95."""
    rows = []
    for workload in report.workloads:
        theirs = {run.arrival: run for run in report.runs_of(workload, real)}
        for run in report.runs_of(workload, sim):
            peer = theirs.get(run.arrival)
            if peer is None:
                continue
            for metric in ("ttft", "tpot"):
                for q in FIDELITY_BOUNDS:
                    rows.append(
                        FidelityRow(
                            workload,
                            run.arrival.label,
                            metric.upper(),
                            q,
                            _get(getattr(peer.summary, metric), q),
                            _get(getattr(run.summary, metric), q),
                        )
                    )
    return rows


def format_fidelity(rows: list[FidelityRow], sim: str = "sim", real: str = "disaggregated") -> str:
    """A markdown table, one row per load point, and how many quantiles are within bounds."""

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1e3:,.0f}"

    def err(row: FidelityRow) -> str:
        if row.error is None:
            return "n/a"
        return f"{row.error:+.0%}" + ("" if row.within else ", out")

    by_point: dict[tuple[str, str], list[FidelityRow]] = {}
    for row in rows:
        by_point.setdefault((row.workload, row.load), []).append(row)
    names = [f"{r.metric} {r.quantile.upper()}" for r in next(iter(by_point.values()), [])]
    header = "| workload | load | " + " | ".join(f"{n} {real} / {sim} ms (error)" for n in names)
    lines = [header + " |", "|---|---|" + "---|" * len(names)]
    for (workload, load), point in by_point.items():
        cells = [f"{ms(r.real)} / {ms(r.sim)} ({err(r)})" for r in point]
        lines.append(f"| {workload} | {load} | " + " | ".join(cells) + " |")
    num_within = sum(r.within for r in rows)
    bounds = ", ".join(f"{q.upper()} within {b:.0%}" for q, b in FIDELITY_BOUNDS.items())
    lines.append(f"\n{num_within} of {len(rows)} quantiles within bounds ({bounds}).")
    return "\n".join(lines)
