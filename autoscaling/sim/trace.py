"""Arrival traces: a piecewise-constant rate over time, length ranges, and a seed.

Arrivals are a Poisson process within each segment; lengths are drawn uniformly from their
ranges. The same trace and seed always give the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple


class RateSegment(NamedTuple):
    duration_s: float
    rate_per_s: float


class LengthRange(NamedTuple):
    """Token counts drawn uniformly from [low, high]."""

    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


class TraceRequest(NamedTuple):
    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ArrivalTrace:
    segments: tuple[RateSegment, ...]
    prompt_tokens: LengthRange
    output_tokens: LengthRange
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a trace needs at least one segment")
        if any(s.duration_s <= 0 or s.rate_per_s < 0 for s in self.segments):
            raise ValueError("segments need duration > 0 and rate >= 0")
        if self.prompt_tokens.low < 1 or self.prompt_tokens.high < self.prompt_tokens.low:
            raise ValueError(f"bad prompt length range {self.prompt_tokens}")
        # One token comes from prefill; TPOT needs at least one more from decode.
        if self.output_tokens.low < 2 or self.output_tokens.high < self.output_tokens.low:
            raise ValueError(f"output lengths must be >= 2, got {self.output_tokens}")

    @property
    def duration_s(self) -> float:
        return sum(s.duration_s for s in self.segments)

    def requests(self) -> list[TraceRequest]:
        rng = random.Random(self.seed)
        requests: list[TraceRequest] = []
        start = 0.0
        for segment in self.segments:
            end = start + segment.duration_s
            t = start
            while segment.rate_per_s > 0:
                t += rng.expovariate(segment.rate_per_s)
                if t >= end:
                    break
                requests.append(
                    TraceRequest(
                        len(requests),
                        t,
                        self.prompt_tokens.sample(rng),
                        self.output_tokens.sample(rng),
                    )
                )
            start = end
        return requests


def steady_trace(
    rate_per_s: float,
    duration_s: float,
    prompt_tokens: LengthRange,
    output_tokens: LengthRange,
    seed: int = 0,
) -> ArrivalTrace:
    return ArrivalTrace((RateSegment(duration_s, rate_per_s),), prompt_tokens, output_tokens, seed)


def bursty_trace(
    base_rate_per_s: float,
    peak_factor: float,
    low_s: float,
    high_s: float,
    num_cycles: int,
    prompt_tokens: LengthRange,
    output_tokens: LengthRange,
    seed: int = 0,
) -> ArrivalTrace:
    """`num_cycles` of (low_s at the base rate, high_s at peak_factor x it), then low again."""
    cycle = (
        RateSegment(low_s, base_rate_per_s),
        RateSegment(high_s, base_rate_per_s * peak_factor),
    )
    segments = cycle * num_cycles + (RateSegment(low_s, base_rate_per_s),)
    return ArrivalTrace(segments, prompt_tokens, output_tokens, seed)
