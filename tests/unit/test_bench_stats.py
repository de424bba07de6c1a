"""The benchmark's math on synthetic records: percentiles, latencies, SLO attainment, goodput,
throughput and cost, each checked against a hand computation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bench.record import RequestRecord
from bench.runner import Arrival, poisson_offsets
from bench.stats import SLO, Distribution, max_rate_meeting_slo, summarize
from engine.autoscaling_stats import percentile_of as percentile


def record(index: int, sent: float, chunks: list[tuple[float, int]], **kw: object) -> RequestRecord:
    return RequestRecord(index, 100, sum(n for _, n in chunks) or 4, sent, chunks, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("p", [0, 1, 25, 50, 90, 95, 99, 100])
def test_percentile_matches_numpy_linear(p: float) -> None:
    rng = random.Random(p)
    for size in (1, 2, 7, 100):
        values = [rng.uniform(0, 10) for _ in range(size)]
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def test_percentile_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="percentile"):
        percentile([1.0], 101)


def test_distribution_of_one_to_hundred() -> None:
    d = Distribution.of([float(v) for v in range(1, 101)])
    assert d is not None
    assert (d.p50, d.p90, d.p95, d.p99) == pytest.approx((50.5, 90.1, 95.05, 99.01))
    assert d.mean == pytest.approx(50.5) and d.count == 100
    assert Distribution.of([]) is None


def test_request_latencies_from_token_arrivals() -> None:
    # Sent at 1.0; first chunk (1 token) at 1.5; then chunks of 1, 2 and 1 tokens.
    r = record(0, 1.0, [(1.5, 1), (1.6, 1), (1.8, 2), (1.9, 1)])
    assert r.num_output_tokens == 5
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(0.9)
    assert r.tpot_s == pytest.approx(0.4 / 4)
    # A 2-token chunk spreads its 0.2 s gap: two gaps of 0.1.
    assert r.itls_s == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert sum(r.itls_s) == pytest.approx(0.9 - 0.5)  # E2E - TTFT


def test_first_chunk_with_several_tokens_gives_zero_gaps() -> None:
    r = record(0, 0.0, [(1.0, 3), (1.3, 1)])
    assert r.itls_s == pytest.approx([0.0, 0.0, 0.3])
    assert r.tpot_s == pytest.approx(0.3 / 3)


def test_failed_and_single_token_requests() -> None:
    failed = record(0, 0.0, [(0.2, 1)], error="UNAVAILABLE: gone")
    assert not failed.ok and failed.ttft_s is None and failed.tpot_s is None
    single = record(1, 0.0, [(0.2, 1)])
    assert single.tpot_s is None and single.itls_s == []
    slo = SLO(ttft_s=0.5, tpot_s=0.01)
    assert slo.is_met_by(single)  # judged on TTFT alone
    assert not slo.is_met_by(failed)


def test_an_itl_slo_fails_a_stream_with_one_long_stall_its_mean_tpot_absorbs() -> None:
    # 11 tokens 0.1 s apart but one gap of 0.6 s: TPOT 0.15 s, P99 gap 0.6 s.
    stalled = record(
        0,
        0.0,
        [
            (0.5, 1),
            *[(0.6 + 0.1 * i, 1) for i in range(5)],
            (1.6, 1),
            *[(1.7 + 0.1 * i, 1) for i in range(4)],
        ],
    )
    assert stalled.tpot_s == pytest.approx(0.15) and max(stalled.itls_s) == pytest.approx(0.6)
    assert SLO(ttft_s=1.0, tpot_s=0.2).is_met_by(stalled)
    assert not SLO(ttft_s=1.0, tpot_s=0.2, itl_s=0.3).is_met_by(stalled)
    assert SLO(ttft_s=1.0, tpot_s=0.2, itl_s=0.7).is_met_by(stalled)
    with pytest.raises(ValueError, match="SLO targets"):
        SLO(1.0, 0.2, itl_s=0.0)


def test_summary_counts_throughput_attainment_goodput_and_cost() -> None:
    records = [
        # meets both: ttft 0.5, tpot 0.1
        record(0, 0.0, [(0.5, 1), (0.6, 1), (0.7, 1)]),
        # TTFT miss: ttft 2.0
        record(1, 1.0, [(3.0, 1), (3.1, 1), (3.2, 1)]),
        # TPOT miss: ttft 0.5, tpot 0.5
        record(2, 2.0, [(2.5, 1), (3.0, 1), (3.5, 1)]),
        # failed
        record(3, 3.0, [], error="RESOURCE_EXHAUSTED: overloaded"),
        # meets both, finishes last at 4.0
        record(4, 3.0, [(3.2, 2), (4.0, 2)]),
    ]
    s = summarize(records, SLO(ttft_s=1.0, tpot_s=0.3), dollars_per_hour=3.6)
    assert (s.num_sent, s.num_completed, s.num_failed) == (5, 4, 1)
    assert s.duration_s == pytest.approx(4.0)  # first send 0.0 -> last token 4.0
    assert s.request_throughput == pytest.approx(4 / 4.0)
    assert s.output_token_throughput == pytest.approx(13 / 4.0)
    assert s.total_token_throughput == pytest.approx((13 + 400) / 4.0)
    assert s.slo_attainment == pytest.approx(2 / 5)
    assert s.goodput == pytest.approx(2 / 4.0)
    # $3.6/hour at 3.25 tok/s = 11,700 tok/hour -> $307.69 per 1M tokens.
    assert s.cost_per_million_output_tokens == pytest.approx(3.6 / (3.25 * 3600) * 1e6)
    assert s.ttft is not None and s.ttft.p50 == pytest.approx(0.5)
    assert s.ttft.count == 4


def test_summary_with_nothing_completed() -> None:
    s = summarize([record(0, 0.0, [], error="x")], SLO(1.0, 1.0), dollars_per_hour=1.0)
    assert s.num_completed == 0 and s.goodput == 0.0 and s.cost_per_million_output_tokens is None
    assert s.ttft is None
    with pytest.raises(ValueError, match="no requests"):
        summarize([], SLO(1.0, 1.0), 1.0)


def test_server_breakdown_is_summarized() -> None:
    from bench.record import ServerTimings

    r = record(0, 0.0, [(0.5, 1), (0.6, 1)], server=ServerTimings(0.01, 0.4, 0.02, 0.45, 0.46, 0.6))
    s = summarize([r], SLO(1.0, 1.0), 1.0)
    assert s.server_prefill is not None and s.server_prefill.p50 == pytest.approx(0.4)
    assert s.server_ttft is not None and s.server_ttft.p50 == pytest.approx(0.45)


def test_max_rate_meeting_slo_stops_at_the_first_miss() -> None:
    sweep = [(0.5, 1.0), (1.0, 0.95), (2.0, 0.7), (4.0, 0.92)]
    assert max_rate_meeting_slo(sweep, 0.9) == 1.0  # 4.0 passing by luck does not count
    assert max_rate_meeting_slo(sweep, 0.96) == 0.5
    assert max_rate_meeting_slo([(0.5, 0.5)], 0.9) is None
    with pytest.raises(ValueError):
        max_rate_meeting_slo(sweep, 0.0)


def test_poisson_offsets_have_the_offered_rate() -> None:
    offsets = poisson_offsets(rate=4.0, n=20_000, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert len(offsets) / offsets[-1] == pytest.approx(4.0, rel=0.03)
    assert poisson_offsets(4.0, 10, seed=1) == offsets[:10]  # seeded


def test_arrival_validation() -> None:
    assert Arrival("poisson", 0.5).label == "0.5 req/s"
    assert Arrival("closed", 1).label == "1 in flight"
    with pytest.raises(ValueError):
        Arrival("poisson", 0)
    with pytest.raises(ValueError):
        Arrival("closed", 1.5)
