"""A benchmark report: every run (system x workload x arrival) with its request records, as
JSON (the records are the source; summaries are recomputed from them on load) and as markdown
tables."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.record import RequestRecord
from bench.runner import Arrival
from bench.stats import SLO, Distribution, RunSummary, max_rate_meeting_slo, summarize


@dataclass
class Run:
    system: str
    workload: str
    arrival: Arrival
    records: list[RequestRecord]
    slo: SLO
    dollars_per_hour: float

    @property
    def summary(self) -> RunSummary:
        return summarize(self.records, self.slo, self.dollars_per_hour)

    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "workload": self.workload,
            "arrival": asdict(self.arrival),
            "slo": asdict(self.slo),
            "dollars_per_hour": self.dollars_per_hour,
            "summary": asdict(self.summary),
            "requests": [r.to_json() for r in self.records],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Run:
        return cls(
            system=data["system"],
            workload=data["workload"],
            arrival=Arrival(**data["arrival"]),
            records=[RequestRecord.from_json(r) for r in data["requests"]],
            slo=SLO(**data["slo"]),
            dollars_per_hour=data["dollars_per_hour"],
        )


@dataclass
class Report:
    meta: dict[str, Any]
    runs: list[Run] = field(default_factory=list)
    attainment_target: float = 0.9

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "meta": self.meta,
            "attainment_target": self.attainment_target,
            "runs": [run.to_json() for run in self.runs],
        }
        path.write_text(json.dumps(body, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Report:
        body = json.loads(path.read_text())
        runs = [Run.from_json(r) for r in body["runs"]]
        return cls(body["meta"], runs, body.get("attainment_target", 0.9))

    def judged_by(self, slo: SLO | None, attainment_target: float | None = None) -> Report:
        """The same records judged against another SLO and/or attainment target."""
        runs = [replace(r, slo=slo or r.slo) for r in self.runs]
        target = self.attainment_target if attainment_target is None else attainment_target
        return Report(self.meta, runs, target)

    def with_prompts_up_to(self, max_prompt_tokens: int) -> Report:
        """The same runs, each with only its requests whose prompt is at most that long: the
        short requests of a mixed workload, judged apart from the long ones beside them."""
        runs = [
            replace(r, records=[x for x in r.records if x.prompt_tokens <= max_prompt_tokens])
            for r in self.runs
        ]
        return Report(self.meta, [r for r in runs if r.records], self.attainment_target)

    @property
    def workloads(self) -> list[str]:
        return list(dict.fromkeys(run.workload for run in self.runs))

    @property
    def systems(self) -> list[str]:
        return list(dict.fromkeys(run.system for run in self.runs))

    def runs_of(self, workload: str, system: str | None = None) -> list[Run]:
        return [
            r
            for r in self.runs
            if r.workload == workload and (system is None or r.system == system)
        ]

    def max_rate_meeting_slo(self, workload: str, system: str) -> float | None:
        sweep = [
            (run.arrival.value, run.summary.slo_attainment)
            for run in self.runs_of(workload, system)
            if run.arrival.kind == "poisson"
        ]
        return max_rate_meeting_slo(sweep, self.attainment_target) if sweep else None


def _ms(d: Distribution | None, attr: str) -> str:
    return "-" if d is None else f"{getattr(d, attr) * 1e3:.0f}"


def markdown(report: Report) -> str:
    facts = report.meta.get("facts", {})
    lines: list[str] = [*_auto_lines(facts), *_role_flip_lines(facts)]
    for workload in report.workloads:
        runs = report.runs_of(workload)
        slo = runs[0].slo
        lines += [
            f"### {workload}",
            "",
            f"SLO: TTFT <= {slo.ttft_s * 1e3:.0f} ms, TPOT <= {slo.tpot_s * 1e3:.0f} ms"
            + ("" if slo.itl_s is None else f", P99 gap <= {slo.itl_s * 1e3:.0f} ms")
            + "; "
            f"cost at ${runs[0].dollars_per_hour:g}/hour. Latencies in ms.",
            "",
            "| system | load | done/sent | req/s | out tok/s | TTFT P50 | P90 | P95 | P99 "
            "| TPOT P50 | P90 | P95 | P99 | ITL P99 | E2E P95 | SLO met | goodput req/s "
            "| $/1M out tok |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for run in runs:
            s = run.summary
            cost = (
                "-"
                if s.cost_per_million_output_tokens is None
                else (f"{s.cost_per_million_output_tokens:.2f}")
            )
            lines.append(
                f"| {run.system} | {run.arrival.label} | {s.num_completed}/{s.num_sent} "
                f"| {s.request_throughput:.3f} | {s.output_token_throughput:.1f} "
                f"| {_ms(s.ttft, 'p50')} | {_ms(s.ttft, 'p90')} | {_ms(s.ttft, 'p95')} "
                f"| {_ms(s.ttft, 'p99')} | {_ms(s.tpot, 'p50')} | {_ms(s.tpot, 'p90')} "
                f"| {_ms(s.tpot, 'p95')} | {_ms(s.tpot, 'p99')} | {_ms(s.itl, 'p99')} "
                f"| {_ms(s.e2e, 'p95')} | {s.slo_attainment:.0%} | {s.goodput:.3f} | {cost} |"
            )
        lines += ["", *_hops_table(runs), ""]
        goodputs = [
            f"{system} {_rate(report.max_rate_meeting_slo(workload, system))}"
            for system in report.systems
            if report.runs_of(workload, system)
        ]
        lines += [
            f"Max offered rate with >= {report.attainment_target:.0%} of requests meeting the "
            f"SLO: {', '.join(goodputs)}.",
            "",
        ]
    return "\n".join(lines)


def _auto_lines(facts: dict[str, Any]) -> list[str]:
    """What `topology: auto` deployed, and why (deploy/plan.py)."""
    rows = [
        f"{system}: `topology: auto` deployed {f['pick']}: {f['reason']}"
        for system, fact in facts.items()
        if (f := fact.get("auto"))
    ]
    return [*rows, ""] if rows else []


def _role_flip_lines(facts: dict[str, Any]) -> list[str]:
    """Each system's role flip time (bench/role_flips.py), where it was measured."""
    rows = [
        f"| {system} | {f['n']} | {f['p50_s'] * 1e3:.0f} | {f['p95_s'] * 1e3:.0f} "
        f"| {f['max_s'] * 1e3:.0f} | {f['num_routers']} |"
        for system, fact in facts.items()
        if (f := fact.get("role_flips"))
    ]
    if not rows:
        return []
    return [
        "Role flips after the load: a decode replica flipped to the prefill pool's calls and "
        "back, each timed from its write until every router applied it (ms).",
        "",
        "| system | flips | P50 | P95 | max | routers |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _hops_table(runs: list[Run]) -> list[str]:
    """Where TTFT goes, medians, for the runs that report a server breakdown."""
    rows = []
    for run in runs:
        s = run.summary
        if s.server_ttft is None or s.ttft is None:
            continue
        outside = s.ttft.p50 - s.server_ttft.p50
        rows.append(
            f"| {run.system} | {run.arrival.label} | {_ms(s.server_queue_wait, 'p50')} "
            f"| {_ms(s.server_prefill, 'p50')} | {_ms(s.server_ttft, 'p50')} "
            f"| {_ms(s.ttft, 'p50')} | {outside * 1e3:.0f} | {_ms(s.server_kv_transfer, 'p50')} "
            f"| {_prefill_split(run.records)} |"
        )
    if not rows:
        return []
    return [
        "Per hop (medians, ms): router queue, prefill call, TTFT as the router measured it, TTFT "
        "as the client saw it, the difference (proxy, network, client), and the KV transfer "
        "(off the TTFT path: the first token is sent before decode starts); then where the "
        "disaggregated requests' prompts were computed, local (on their decode replica) : "
        "remote (the prefill pool).",
        "",
        "| system | load | router queue | prefill | server TTFT | client TTFT | outside router "
        "| KV transfer | prefill local:remote |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def _prefill_split(records: list[RequestRecord]) -> str:
    """ "local:remote" counts of the records whose server said where it prefilled; "-" for
    none (colocated, or records saved before servers said)."""
    paths = Counter(r.server.prefill_path for r in records if r.server and r.server.prefill_path)
    return f"{paths['local']}:{paths['remote']}" if paths else "-"


def _rate(rate: float | None) -> str:
    return "none of the rates" if rate is None else f"{rate:g} req/s"
