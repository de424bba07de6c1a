"""The circuit breaker in front of the prefix index in Redis."""

from __future__ import annotations

import pytest

from router.breaker import CircuitBreaker


def test_it_opens_after_the_threshold_lets_one_trial_through_and_closes_on_success() -> None:
    now = [0.0]
    breaker = CircuitBreaker(threshold=3, open_s=5.0, clock=lambda: now[0])
    for _ in range(2):
        assert breaker.allow()
        breaker.failed()
    assert not breaker.is_open and breaker.allow()
    breaker.failed()  # the third in a row
    assert breaker.is_open and not breaker.allow()
    now[0] = 4.9
    assert not breaker.allow()
    now[0] = 5.0
    assert breaker.allow()  # the trial
    assert not breaker.allow()  # one trial at a time
    breaker.succeeded()
    assert not breaker.is_open and breaker.allow() and breaker.allow()


def test_a_failed_trial_opens_it_again_and_a_success_resets_the_count() -> None:
    now = [0.0]
    breaker = CircuitBreaker(threshold=2, open_s=1.0, clock=lambda: now[0])
    breaker.failed()
    breaker.succeeded()
    breaker.failed()
    assert not breaker.is_open  # not two in a row
    breaker.failed()
    assert breaker.is_open
    now[0] = 1.5
    assert breaker.allow()
    breaker.failed()  # the trial failed: open for another second
    assert not breaker.allow()
    now[0] = 2.6
    assert breaker.allow()


@pytest.mark.parametrize(("threshold", "open_s"), [(0, 1.0), (1, 0.0)])
def test_bad_settings_are_refused(threshold: int, open_s: float) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(threshold, open_s)
