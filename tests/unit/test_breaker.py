"""The circuit breaker in front of the prefix index in Redis, and the best-effort writes behind
one (latency samples, replica status)."""

from __future__ import annotations

import pytest

from control.breaker import CircuitBreaker


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


async def test_best_effort_writes_are_bounded_skipped_and_logged_once_per_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import asyncio
    import logging

    from control.breaker import BestEffort

    now = [0.0]
    writes = BestEffort(
        "writing samples", logging.getLogger("test.best_effort"), timeout_s=0.05,
        breaker=CircuitBreaker(threshold=2, open_s=5.0, clock=lambda: now[0]),
    )  # fmt: skip
    made: list[str] = []

    async def ok() -> None:
        made.append("ok")

    async def refused() -> None:
        made.append("refused")
        raise ConnectionError("connection refused")

    async def silent() -> None:
        made.append("silent")
        await asyncio.sleep(10)

    with caplog.at_level(logging.WARNING, logger="test.best_effort"):
        assert await writes.run(ok)
        assert not await writes.run(refused)
        assert not await writes.run(silent)  # gives up at its 50 ms bound: the second failure
        assert writes.breaker.is_open
        for _ in range(5):  # skipped, not attempted
            assert not await writes.run(ok)
        now[0] = 5.0
        assert await writes.run(ok)  # the trial write closes the breaker
    assert made == ["ok", "refused", "silent", "ok"]
    assert [r.getMessage() for r in caplog.records] == [
        "writing samples failing (ConnectionError: connection refused); skipped until a trial "
        "write succeeds",
        "writing samples working again",
    ]


def test_best_effort_timeout_must_be_positive() -> None:
    import logging

    from control.breaker import BestEffort

    with pytest.raises(ValueError, match="timeout_s"):
        BestEffort("x", logging.getLogger("x"), timeout_s=0)
