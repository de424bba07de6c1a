"""The per-request local / remote prefill decision (router/pd_decision.py)."""

from __future__ import annotations

import pytest

from router.pd_decision import (
    EXPLORE_EVERY,
    MIN_TPOT_TOKENS,
    LinearFit,
    Mean,
    PDDecider,
    PDInputs,
    PoolSnapshot,
    RecentQuantile,
    StallBudget,
)


def test_the_fit_recovers_a_line_and_falls_back_to_the_origin() -> None:
    fit = LinearFit(window=8, min_samples=3)
    fit.add(100, 0.3)
    fit.add(200, 0.5)
    assert fit.line() is None and fit.predict(100) is None
    fit.add(400, 0.9)
    intercept, slope = fit.line()  # type: ignore[misc]
    assert intercept == pytest.approx(0.1) and slope == pytest.approx(0.002)
    assert fit.predict(1000) == pytest.approx(2.1)
    same = LinearFit(min_samples=2)  # no spread in tokens: through the origin
    same.add(50, 0.1)
    same.add(50, 0.3)
    assert same.line() == (0.0, pytest.approx(0.004))
    noisy = LinearFit(min_samples=2)  # a negative slope from noise: through the origin
    noisy.add(100, 0.5)
    noisy.add(200, 0.4)
    assert noisy.line()[0] == 0.0 and noisy.line()[1] > 0  # type: ignore[index]
    hops = LinearFit(min_samples=2, fallback="constant")  # or their mean, for fixed costs
    hops.add(186, 0.12)
    hops.add(186, 0.16)
    assert hops.line() == (pytest.approx(0.14), 0.0)
    assert hops.predict(1500) == pytest.approx(0.14)


def test_the_fit_keeps_the_last_window_and_ignores_empty_samples() -> None:
    fit = LinearFit(window=3, min_samples=3)
    for tokens in (10, 20, 30):
        fit.add(tokens, 1.0)  # an old regime
    for tokens in (10, 20, 30):
        fit.add(tokens, tokens * 0.01)
    assert fit.line() == (pytest.approx(0.0, abs=1e-12), pytest.approx(0.01))
    fit.add(0, 5.0)
    fit.add(10, -1.0)
    assert len(fit) == 3


def test_mean_weights_new_values() -> None:
    mean = Mean(weight=0.5)
    assert mean.value is None
    mean.add(1.0)
    mean.add(3.0)
    assert mean.value == 2.0


def test_recent_quantile_keeps_the_tail_of_a_window() -> None:
    tail = RecentQuantile(0.95, window=20)
    assert tail.value is None
    for value in range(1, 21):
        tail.add(float(value))
    assert tail.value == 20.0  # the 95th percentile of 20 values: the highest
    for _ in range(19):
        tail.add(1.0)
    assert tail.value == 20.0  # still in the window
    tail.add(1.0)
    assert tail.value == 1.0
    with pytest.raises(ValueError, match="q"):
        RecentQuantile(0.0)


def test_the_tpot_tail_not_the_mean_limits_local_prefills() -> None:
    """TPOT's SLO is a P95: one stream in 10 at the SLO leaves the local path no headroom,
    though the mean TPOT is well under it (the mean let local prefills pile onto a decode
    engine until half its streams missed; deploy/plan.py measured it)."""
    decider = fitted(tpot_slo_s=0.3)
    assert decider.decide(inputs(500, running=8)).path == "local"
    for i in range(20):
        decider.observe(1000, 1.05, 0.12, 0.3 if i % 10 == 0 else 0.1, 100)
    decision = decider.decide(inputs(500, running=8))
    assert decision.path == "remote" and decision.headroom_s == 0.0, decision.describe()
    # A short answer's TPOT is mostly its one handoff gap: not counted.
    decider = fitted(tpot_slo_s=0.3)
    for _ in range(20):
        decider.observe(1000, 1.05, 0.12, 1.0, MIN_TPOT_TOKENS - 1)
    assert decider.decide(inputs(500, running=8)).path == "local"


def fitted(tpot_slo_s: float = 0.3, stall_budget: StallBudget = "stream") -> PDDecider:
    """Prefill: 0.05 s + 1 ms per token; transfer: 0.02 s + 0.1 ms per token; TPOT 0.1 s over
    100-token outputs."""
    decider = PDDecider(tpot_slo_s, stall_budget=stall_budget)
    for tokens in (100, 500, 1000, 2000):
        decider.observe(tokens, 0.05 + 0.001 * tokens, 0.02 + 0.0001 * tokens, 0.1, 100)
    return decider


def inputs(
    prompt: int,
    prefill_queue: int = 0,
    decode_queue: int = 0,
    running: int = 0,
    cached: int = 0,
    age_s: float = 0.0,
) -> PDInputs:
    return PDInputs(
        prompt,
        cached,
        PoolSnapshot(prefill_queue, 0, age_s),
        PoolSnapshot(decode_queue, running, 0.0),
    )


def test_an_idle_system_prefills_locally_a_transfer_costs_more() -> None:
    decision = fitted().decide(inputs(1000))
    assert decision.path == "local", decision.describe()
    assert decision.local_ttft_s == pytest.approx(1.05)
    assert decision.remote_ttft_s == pytest.approx(1.05 + 0.12)


def test_a_busy_decode_engine_sends_long_prompts_remote() -> None:
    # 1,000 tokens stall 8 running streams 1.05 s; their headroom is (0.3 - 0.1) x 100 = 20 s
    # of mean-TPOT budget: local is fine. A tight SLO leaves no room.
    assert fitted().decide(inputs(1000, running=8)).path == "local"
    decision = fitted(tpot_slo_s=0.105).decide(inputs(1000, running=8))
    assert decision.path == "remote", decision.describe()
    assert decision.stall_s == pytest.approx(1.05) and decision.headroom_s == pytest.approx(0.5)
    assert "stall 8 streams" in decision.reason


def test_queues_move_the_prompt_to_the_idler_pool() -> None:
    # Decode has 3,000 tokens to prefill before this one: 3 s; prefill is idle.
    assert fitted().decide(inputs(500, decode_queue=3000)).path == "remote"
    # Prefill has 3,000 queued, reported 2.5 s ago: 0.5 s of it left.
    decision = fitted().decide(inputs(500, prefill_queue=3000, decode_queue=600, age_s=2.5))
    assert decision.remote_ttft_s == pytest.approx(0.05 + 0.5 + 0.5 + 0.07)
    assert decision.local_ttft_s == pytest.approx(0.6 + 0.55)
    assert decision.path == "remote"


def test_prefix_cached_tokens_on_the_prefill_side_count_for_remote() -> None:
    cold = fitted().decide(inputs(2000, decode_queue=200))
    warm = fitted().decide(inputs(2000, decode_queue=200, cached=1800))
    assert cold.path == "local" and warm.path == "remote"
    assert warm.remote_ttft_s == pytest.approx(0.05 + 0.2 + 0.22)


def test_a_missing_signal_means_local_and_the_transfer_rate_is_learned() -> None:
    decider = PDDecider(0.3)
    paths = [decider.decide(inputs(100)).path for _ in range(2 * EXPLORE_EVERY)]
    assert paths == (["remote"] + ["local"] * (EXPLORE_EVERY - 1)) * 2
    assert decider.decide(inputs(100)).reason == "learning the transfer rate"
    assert decider.decide(inputs(100)).reason == "no fitted prefill rate yet"
    ready = fitted()
    stale = PDInputs(100, 0, PoolSnapshot(0, 0, 0.0), PoolSnapshot(0, 0, 11.0))
    assert ready.decide(stale).describe().startswith("local: no recent decode pool load")
    assert ready.decide(PDInputs(100, 0, None, PoolSnapshot(0, 0, 0.0))).reason == (
        "no prefill pool load"
    )
    # An old prefill load counts, its queue worked off: 30 s ago it had 60 s of work.
    old = PDInputs(100, 0, PoolSnapshot(60_000, 0, 30.0), PoolSnapshot(0, 0, 0.0))
    assert ready.decide(old).remote_ttft_s == pytest.approx(0.05 + 30 + 0.1 + 0.03)
    untimed = PDDecider(0.3)
    for tokens in (100, 500, 1000):
        untimed.observe(tokens, 0.001 * tokens, 0.01, None, 1)
    decision = untimed.decide(inputs(100, running=2))
    assert (decision.path, decision.reason) == ("local", "no observed TPOT yet")


def test_a_one_token_stall_budget_sends_long_prompts_remote_while_streams_run() -> None:
    # The streams' gap is their median TPOT, 0.1 s, the step's fixed 0.05 s in it; a local
    # prompt adds its own compute, 1 ms a token: 1,000 tokens add 1 s against one token's
    # headroom of 0.3 - 0.1 = 0.2 s.
    token = fitted(stall_budget="token")
    decision = token.decide(inputs(1000, running=8))
    assert decision.path == "remote" and decision.headroom_s == pytest.approx(0.2)
    assert decision.stall_s == pytest.approx(1.0) and "TPOT SLO" in decision.reason
    # 150 tokens add 0.15 s: within one token's headroom, and sooner locally.
    assert token.decide(inputs(150, running=8)).path == "local"
    # No stream running: nothing to stall, the sooner path.
    assert token.decide(inputs(1000)).path == "local"


def test_an_itl_slo_bounds_the_one_gap_a_local_prompt_adds() -> None:
    """Under an ITL SLO each gap is bounded: the headroom is that SLO less the streams'
    median TPOT (their usual gap), not their TPOT tail, which a few slow streams set."""
    decider = PDDecider(0.3, stall_budget="token", itl_slo_s=0.35)
    for tokens in (100, 500, 1000, 2000, 300, 700, 1500):
        tpot = 0.25 if tokens in (300, 700, 1500) else 0.1  # 3 of 7 slow: P95 0.25, median 0.1
        decider.observe(tokens, 0.05 + 0.001 * tokens, 0.02 + 0.0001 * tokens, tpot, 100)
    assert decider.decide(inputs(240, running=8)).path == "local"
    decision = decider.decide(inputs(260, running=8))
    assert decision.path == "remote" and "ITL SLO" in decision.reason, decision.describe()
    assert decision.headroom_s == pytest.approx(0.25) and decision.stall_s == pytest.approx(0.26)
    with pytest.raises(ValueError, match="itl_slo_s"):
        PDDecider(0.3, itl_slo_s=0.0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="stall_budget"):
        PDDecider(0.3, stall_budget="request")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tpot_slo_s"):
        PDDecider(0.0)
    with pytest.raises(ValueError, match="window"):
        LinearFit(window=1)
    with pytest.raises(ValueError, match="weight"):
        Mean(weight=0.0)


def test_with_no_engine_serving_prefill_every_prompt_is_local_and_none_explores() -> None:
    """The split lent every prefill engine to decoding (autoscaling/roles.py): a prompt that
    would stall the streams, and the unfitted decider's exploring request, stay local."""
    alone = PDInputs(4000, 0, None, PoolSnapshot(0, 8, 0.0), no_prefill_engine=True)
    assert fitted(tpot_slo_s=0.105).decide(alone).path == "local"
    unfitted = PDDecider(0.3)
    decisions = [unfitted.decide(alone) for _ in range(2 * EXPLORE_EVERY)]
    assert {(d.path, d.reason) for d in decisions} == {("local", "no engine serves prefill")}
