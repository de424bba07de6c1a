"""Lease bookkeeping behind the KVLeaseRegistry actor (pure, fake clock)."""

from __future__ import annotations

import pytest

from kv_transfer.leases import TOMBSTONE_SECONDS, LeaseTable
from tests.clock import FakeClock


def make_table() -> tuple[LeaseTable[str], FakeClock]:
    clock = FakeClock()
    return LeaseTable(clock), clock


def test_take_lends_until_release() -> None:
    table, _ = make_table()
    assert table.register("k", "kv", lease_seconds=10) == 1010.0
    lease = table.take("k")
    assert lease is not None and lease.payload == "kv"
    assert table.take("k") is not None  # taking does not consume the lease
    assert table.release("k") is True
    assert table.take("k") is None
    assert table.release("k") is False
    assert table.num_live() == 0


def test_expired_leases_are_gone_and_swept() -> None:
    table, clock = make_table()
    table.register("short", "a", lease_seconds=1)
    table.register("long", "b", lease_seconds=100)
    clock.now += 1
    assert table.take("short") is None
    table.register("short2", "c", lease_seconds=1)
    clock.now += 5
    assert table.sweep_expired() == ["short2"]
    assert table.num_live() == 1
    clock.now += 100
    assert table.num_live() == 0


def test_register_again_replaces_and_renews() -> None:
    table, clock = make_table()
    table.register("k", "old", lease_seconds=1)
    clock.now += 0.5
    table.register("k", "new", lease_seconds=1)
    clock.now += 0.9
    lease = table.take("k")
    assert lease is not None and lease.payload == "new"
    assert table.num_live() == 1


def test_release_many_counts_only_live_keys() -> None:
    table, _ = make_table()
    table.register("a", "1", lease_seconds=5)
    table.register("b", "2", lease_seconds=5)
    assert table.release_many(["a", "b", "c"]) == 2
    assert table.num_live() == 0


def test_lease_must_be_positive() -> None:
    table, _ = make_table()
    with pytest.raises(ValueError):
        table.register("k", "v", lease_seconds=0)


def test_release_before_registration_refuses_the_late_registration() -> None:
    # The ray-tiny leak: a request aborted right after its save was scheduled is released by
    # vLLM's scheduler while its worker is still registering the save (async scheduling).
    table, clock = make_table()
    assert table.release("late") is False
    assert table.register("late", "kv", lease_seconds=60) == clock.now
    assert table.num_live() == 0 and table.take("late") is None
    # Other keys are unaffected, and tombstones go with time.
    table.register("other", "kv", lease_seconds=60)
    assert table.num_live() == 1
    table.release("never-registered")
    assert table.num_tombstones == 2
    clock.now += TOMBSTONE_SECONDS + 1
    table.sweep_expired()
    assert table.num_tombstones == 0
    assert table.register("never-registered", "kv", lease_seconds=60) > clock.now


def test_a_registration_repeated_after_its_release_is_refused() -> None:
    # What can leave a lease after a link cut: the producer's register call ran, its reply was
    # lost with the link, the consumer pulled the KV and released the key, and then the call
    # ran again (Ray retries a registry call it had no reply to).
    table, clock = make_table()
    table.register("k", "kv", lease_seconds=60)
    assert table.release("k") is True
    for _ in range(3):  # max_task_retries
        assert table.register("k", "kv", lease_seconds=60) == clock.now
    assert table.num_live() == 0 and table.take("k") is None
    assert table.release("k") is False  # releasing again is harmless


def test_release_by_owner_drops_its_leases_and_refuses_its_late_registrations() -> None:
    table, clock = make_table()
    table.register("P/r1:a/n1", "kv1", lease_seconds=60.0)
    table.register("P/r1:b/n2", "retry", lease_seconds=60.0)  # another attempt of r1
    table.register("P/r10:a/n3", "other", lease_seconds=60.0)  # a prefix of it, not the owner
    assert table.release_owner("P/r1:a") == 1
    assert table.live_keys() == ["P/r10:a/n3", "P/r1:b/n2"]
    # The engine registers the abandoned attempt's store after the release: refused.
    assert table.register("P/r1:a/n4", "late", lease_seconds=60.0) == clock.now
    assert table.take("P/r1:a/n4") is None
    assert table.register("P/r1:b/n5", "kept", lease_seconds=60.0) > clock.now
    # The owner's tombstone goes with time like the key ones.
    assert table.num_tombstones == 1
    clock.now += TOMBSTONE_SECONDS + 1
    table.sweep_expired()
    assert table.num_tombstones == 0
    assert table.register("P/r1:a/n6", "much later", lease_seconds=60.0) > clock.now


def test_live_leases_of_one_producer() -> None:
    """What a stopping producer waits on: its own live leases, not a namesake's."""
    table, clock = make_table()
    table.register("prefill-a/req-1/n1", "kv", lease_seconds=10)
    table.register("prefill-a/req-2/n2", "kv", lease_seconds=1)
    table.register("prefill-ab/req-1/n3", "kv", lease_seconds=10)
    assert (table.num_live("prefill-a"), table.num_live("prefill-ab")) == (2, 1)
    assert table.num_live("prefill") == 0
    clock.now += 2
    assert table.num_live("prefill-a") == 1
    table.release("prefill-a/req-1/n1")
    assert (table.num_live("prefill-a"), table.num_live()) == (0, 1)
