"""The router's memory of replicas that failed a request: each is avoided for a while."""

from __future__ import annotations

from router.pools import RecentFailures


def test_a_failed_replica_is_avoided_until_its_time_runs_out() -> None:
    now = [100.0]
    failures = RecentFailures(ttl_s=30.0, clock=lambda: now[0])
    assert failures.recent() == frozenset()
    failures.mark("decode-a")
    now[0] = 110.0
    failures.mark("prefill-b")
    assert failures.recent() == {"decode-a", "prefill-b"}
    now[0] = 130.5
    assert failures.recent() == {"prefill-b"}
    failures.mark("prefill-b")  # failed again: its time starts over
    now[0] = 150.0
    assert failures.recent() == {"prefill-b"}
    now[0] = 161.0
    assert failures.recent() == frozenset()
