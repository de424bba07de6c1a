"""PNG plots of a report, per workload: latency CDFs (TTFT, TPOT) at the lowest offered load,
and TTFT P95 / TPOT P95 against the offered rate, one line per system."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import Report, Run


def plot_report(report: Report, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for workload in report.workloads:
        paths.append(_cdfs(report, workload, out_dir / f"{workload}-cdf.png"))
        if any(r.arrival.kind == "poisson" for r in report.runs_of(workload)):
            paths.append(_versus_rate(report, workload, out_dir / f"{workload}-vs-rate.png"))
    return paths


def _cdfs(report: Report, workload: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for system in report.systems:
        runs = report.runs_of(workload, system)
        if not runs:
            continue
        run = min(runs, key=lambda r: r.arrival.value)
        for ax, values in zip(axes, _latencies(run), strict=True):
            if values:
                ordered = sorted(v * 1e3 for v in values)
                fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
                ax.step(ordered, fractions, where="post", label=f"{system} ({run.arrival.label})")
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)"), strict=True):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
    return _save(fig, axes, f"{workload}: latency CDF at the lowest offered load", path)


def _latencies(run: Run) -> tuple[list[float], list[float]]:
    done = [r for r in run.records if r.ok]
    return (
        [r.ttft_s for r in done if r.ttft_s is not None],
        [r.tpot_s for r in done if r.tpot_s is not None],
    )


def _versus_rate(report: Report, workload: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    slo = report.runs_of(workload)[0].slo
    for system in report.systems:
        runs = sorted(
            (r for r in report.runs_of(workload, system) if r.arrival.kind == "poisson"),
            key=lambda r: r.arrival.value,
        )
        if not runs:
            continue
        for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
            points = [
                (r.arrival.value, getattr(r.summary, metric).p95 * 1e3)
                for r in runs
                if getattr(r.summary, metric) is not None
            ]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=system)
    for ax, name, limit in zip(
        axes, ("TTFT P95 (ms)", "TPOT P95 (ms)"), (slo.ttft_s, slo.tpot_s), strict=True
    ):
        ax.axhline(limit * 1e3, color="grey", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(name)
    return _save(fig, axes, f"{workload}: P95 latency against offered rate", path)


def _save(fig: Any, axes: Any, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
