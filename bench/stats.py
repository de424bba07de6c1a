"""The report's math, pure: percentiles, throughput, SLO attainment, goodput and cost.

Definitions (docs/benchmarks.md repeats them):
- duration: from the first request sent to the last token received;
- throughput: completed requests and output tokens per second of that duration;
- a request meets the SLOs when it completed, TTFT <= ttft_s and TPOT <= tpot_s (a request with
  one output token has no TPOT and is judged on TTFT alone), and, where an ITL SLO is set, the
  P99 of its inter-token gaps (nearest rank, as the planner judges it) <= itl_s; failed
  requests never meet them;
- attainment: the fraction of sent requests that met the SLOs;
- goodput: requests that met the SLOs per second of the duration (DistServe's);
- max rate meeting the SLOs: the highest offered rate of a sweep whose attainment reached the
  target (default 90%), DistServe's per-system goodput;
- cost per 1M output tokens: dollars_per_hour / (output tokens per hour) x 1e6.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.record import RequestRecord
from engine.autoscaling_stats import percentile_of
from router.pd_decision import request_itl_s

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    itl_s: float | None = None  # a request's P99 gap; None: no ITL bound

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0 and (self.itl_s is None or self.itl_s > 0)):
            raise ValueError(f"SLO targets must be > 0, got {self}")

    def is_met_by(self, record: RequestRecord) -> bool:
        ttft, tpot = record.ttft_s, record.tpot_s
        if ttft is None or ttft > self.ttft_s or (tpot is not None and tpot > self.tpot_s):
            return False
        return self.itl_s is None or request_itl_s(record.itls_s) <= self.itl_s


@dataclass(frozen=True)
class Distribution:
    """Percentiles and mean of one latency, in seconds; None when nothing was measured."""

    p50: float
    p90: float
    p95: float
    p99: float
    mean: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution | None:
        if not values:
            return None
        p50, p90, p95, p99 = (percentile_of(values, p) for p in PERCENTILES)
        return cls(p50, p90, p95, p99, sum(values) / len(values), len(values))


@dataclass(frozen=True)
class RunSummary:
    num_sent: int
    num_completed: int
    num_failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_token_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s of completed requests
    slo_attainment: float
    goodput: float  # requests meeting the SLOs / s
    cost_per_million_output_tokens: float | None  # None when no token came out
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    # The server's breakdown, where the target reports one.
    server_queue_wait: Distribution | None
    server_prefill: Distribution | None
    server_kv_transfer: Distribution | None
    server_ttft: Distribution | None


def summarize(records: Sequence[RequestRecord], slo: SLO, dollars_per_hour: float) -> RunSummary:
    if not records:
        raise ValueError("no requests to summarize")
    if dollars_per_hour < 0:
        raise ValueError(f"dollars_per_hour must be >= 0, got {dollars_per_hour}")
    done = [r for r in records if r.ok]
    start = min(r.sent_s for r in records)
    end = max((r.finished_s for r in done if r.finished_s is not None), default=start)
    duration = end - start
    output_tokens = sum(r.num_output_tokens for r in done)
    total_tokens = output_tokens + sum(r.prompt_tokens for r in done)
    num_good = sum(slo.is_met_by(r) for r in records)

    def per_s(count: float) -> float:
        return count / duration if duration > 0 else 0.0

    tokens_per_hour = per_s(output_tokens) * 3600
    servers = [r.server for r in done if r.server is not None]
    return RunSummary(
        num_sent=len(records),
        num_completed=len(done),
        num_failed=len(records) - len(done),
        duration_s=duration,
        request_throughput=per_s(len(done)),
        output_token_throughput=per_s(output_tokens),
        total_token_throughput=per_s(total_tokens),
        slo_attainment=num_good / len(records),
        goodput=per_s(num_good),
        cost_per_million_output_tokens=(
            dollars_per_hour / tokens_per_hour * 1e6 if tokens_per_hour > 0 else None
        ),
        ttft=Distribution.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=Distribution.of([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=Distribution.of([gap for r in done for gap in r.itls_s]),
        e2e=Distribution.of([r.e2e_s for r in done if r.e2e_s is not None]),
        server_queue_wait=Distribution.of([s.queue_wait_s for s in servers]),
        server_prefill=Distribution.of([s.prefill_s for s in servers]),
        # Only requests that reached a decode pool moved KV (not colocated, not 1-token ones).
        server_kv_transfer=Distribution.of([s.kv_transfer_s for s in servers if s.decode_start_s]),
        server_ttft=Distribution.of([s.ttft_s for s in servers]),
    )


def max_rate_meeting_slo(
    attainment_by_rate: Sequence[tuple[float, float]], target: float = 0.9
) -> float | None:
    """The highest rate whose attainment reached `target`, provided every lower rate did too
    (a sweep that fails at 1 req/s and passes at 2 by luck has a goodput of what came before).
    None when even the lowest rate missed."""
    if not 0 < target <= 1:
        raise ValueError(f"attainment target must be in (0, 1], got {target}")
    best: float | None = None
    for rate, attainment in sorted(attainment_by_rate):
        if attainment < target:
            break
        best = rate
    return best
