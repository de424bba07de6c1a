"""TimingClock: the fields each streamed message carries, in the order the router sets them."""

from __future__ import annotations

import time

import pytest

from router.timings import TimingClock


def test_timings_follow_the_request() -> None:
    clock = TimingClock()
    time.sleep(0.02)
    clock.prefill_done(clock.since_arrival(), prefill_compute_s=0.01)
    clock.tokens_sent(1)
    first = clock.snapshot()
    assert first.ttft_s >= 0.02 and first.prefill_s == pytest.approx(0.01)
    assert first.queue_wait_s == pytest.approx(first.ttft_s - 0.01, abs=0.005)
    assert first.decode_start_s == 0.0  # decode has not been called yet
    clock.decode_started()
    time.sleep(0.01)
    clock.first_decode_token(None)
    for _ in range(4):
        time.sleep(0.005)
        clock.tokens_sent(1)
    last = clock.finish()
    assert last.decode_start_s >= first.ttft_s
    assert last.kv_transfer_s >= 0.01
    assert last.e2e_s > last.decode_start_s
    assert last.mean_tpot_s == pytest.approx((last.e2e_s - last.ttft_s) / 4)


def test_prefill_compute_never_exceeds_the_call() -> None:
    clock = TimingClock()
    clock.prefill_done(prefill_call_s=0.001, prefill_compute_s=5.0)
    assert clock.snapshot().prefill_s == 0.001


def test_a_one_token_answer_has_no_tpot() -> None:
    clock = TimingClock()
    clock.tokens_sent(1)
    assert clock.finish().mean_tpot_s == 0.0


def test_no_decode_call_means_no_kv_transfer() -> None:
    # The colocated topology: one engine streams every token; nothing is transferred.
    clock = TimingClock()
    clock.prefill_done(clock.since_arrival(), prefill_compute_s=0.0)
    clock.tokens_sent(1)
    time.sleep(0.01)
    clock.first_decode_token(None)
    clock.tokens_sent(1)
    last = clock.finish()
    assert (last.kv_transfer_s, last.decode_start_s) == (0.0, 0.0)
