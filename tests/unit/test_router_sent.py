"""router/sent.py: what a router sent each replica since the replica's last load report."""

import pytest

from router.sent import SentSinceReport
from tests.clock import FakeClock


def test_sends_after_a_report_count_until_a_newer_report_covers_them() -> None:
    clock = FakeClock()
    sent = SentSinceReport(horizon_s=10, clock=clock)
    reported_at = clock.now - 0.5
    sent.record("a", 300)
    clock.now += 0.1
    sent.record("a", 200)
    sent.record("b", 50)
    assert sent.since("a", reported_at) == (500, 2)
    assert sent.since("b", reported_at) == (50, 1)
    # A report taken between the two sends to "a" covers the first one only.
    assert sent.since("a", clock.now - 0.05) == (200, 1)
    assert sent.since("a", clock.now) == (0, 0)
    assert sent.since("c", reported_at) == (0, 0)


def test_without_a_report_sends_count_for_the_horizon_only() -> None:
    clock = FakeClock()
    sent = SentSinceReport(horizon_s=2, clock=clock)
    sent.record("a", 100)
    clock.now += 1
    sent.record("a", 40)
    assert sent.since("a", None) == (140, 2)
    clock.now += 1.5  # the first send is past the horizon
    assert sent.since("a", None) == (40, 1)


def test_a_replica_sent_nothing_within_the_horizon_is_forgotten() -> None:
    clock = FakeClock()
    sent = SentSinceReport(horizon_s=2, clock=clock)
    sent.record("gone", 100)
    clock.now += 3
    sent.record("a", 1)
    assert len(sent) == 1
    assert sent.since("gone", None) == (0, 0)


def test_a_horizon_must_be_positive() -> None:
    with pytest.raises(ValueError, match="horizon_s"):
        SentSinceReport(horizon_s=0)
