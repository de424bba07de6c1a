"""What a simulation run produced: per-request latencies, scale events, cost, and summaries."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

from autoscaling.history import ScaleEvent
from control.records import PoolSLO
from engine.autoscaling_stats import percentile

PoolName = Literal["prefill", "decode"]


class RequestOutcome(NamedTuple):
    request_id: int
    arrival_s: float
    ttft_s: float  # nan if the request never got its first token
    tpot_s: float  # nan if it never finished
    is_rejected: bool = False  # it could never fit one decode replica's KV cache

    @property
    def is_finished(self) -> bool:
        return not math.isnan(self.tpot_s)

    def meets(self, slo: PoolSLO) -> bool:
        return self.is_finished and self.ttft_s <= slo.ttft_p95_s and self.tpot_s <= slo.tpot_p95_s


class PoolEvent(NamedTuple):
    pool: PoolName
    event: ScaleEvent


@dataclass(frozen=True)
class SimResult:
    policy_name: str
    slo: PoolSLO
    trace_duration_s: float
    end_s: float
    outcomes: tuple[RequestOutcome, ...]
    events: tuple[PoolEvent, ...]
    prefill_replica_s: float
    decode_replica_s: float
    peak_prefill_replicas: int
    peak_decode_replicas: int

    @property
    def num_arrived(self) -> int:
        return len(self.outcomes)

    @property
    def num_finished(self) -> int:
        return sum(o.is_finished for o in self.outcomes)

    @property
    def num_rejected(self) -> int:
        return sum(o.is_rejected for o in self.outcomes)

    @property
    def num_unfinished(self) -> int:
        return self.num_arrived - self.num_finished - self.num_rejected

    @property
    def num_meeting_slo(self) -> int:
        return sum(o.meets(self.slo) for o in self.outcomes)

    @property
    def slo_attainment(self) -> float:
        """Share of arrived requests that finished within both SLOs."""
        return self.num_meeting_slo / self.num_arrived if self.outcomes else 1.0

    @property
    def goodput_per_s(self) -> float:
        """Requests per second of trace that finished within both SLOs."""
        return self.num_meeting_slo / self.trace_duration_s

    def ttft_p(self, q: float = 95.0) -> float | None:
        return percentile([o.ttft_s for o in self.outcomes if not math.isnan(o.ttft_s)], q)

    def tpot_p(self, q: float = 95.0) -> float | None:
        return percentile([o.tpot_s for o in self.outcomes if o.is_finished], q)

    def num_events(self, pool: PoolName) -> int:
        return sum(e.pool == pool for e in self.events)

    def events_after(self, start_s: float, pool: PoolName | None = None) -> list[PoolEvent]:
        return [
            e for e in self.events if e.event.at_s >= start_s and (pool is None or e.pool == pool)
        ]
