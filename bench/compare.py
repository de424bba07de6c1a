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
