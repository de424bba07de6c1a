"""Prefill and decode replica choice: affinity, load fallback, KV fit (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.policy import (
    DecodeChoice,
    DecodeReason,
    DecodeReplicaState,
    PrefillChoice,
    PrefillPolicyConfig,
    PrefillReason,
    PrefillReplicaState,
    choose_decode_replica,
    choose_prefill_replica,
)
from router.prefix import PrefixIndex, block_hashes

BLOCK = 16
PROMPT = tuple(range(100))  # 6 full blocks
HASHES = block_hashes(PROMPT, BLOCK)
CONFIG = PrefillPolicyConfig(min_match_blocks=2, max_imbalance_tokens=1000)


def prefill(
    replica_id: str, pending: int, *, is_healthy: bool = True, seqs: int = 0
) -> PrefillReplicaState:
    return PrefillReplicaState(replica_id, pending, is_healthy, num_seqs=seqs)


def decode(
    replica_id: str,
    free: int,
    *,
    total: int = 100,
    running: int = 0,
    waiting: int = 0,
    is_healthy: bool = True,
) -> DecodeReplicaState:
    return DecodeReplicaState(replica_id, free, total, running, waiting, is_healthy)


def index_with(owner: str, num_blocks: int) -> PrefixIndex:
    index = PrefixIndex(ttl_seconds=60, clock=lambda: 0.0)
    index.record(HASHES[:num_blocks], owner)
    return index


def test_prefill_prefers_the_replica_with_the_cached_prefix() -> None:
    replicas = [prefill("a", 0), prefill("b", 500), prefill("c", 100)]
    choice = choose_prefill_replica(replicas, HASHES, index_with("b", 4), CONFIG)
    assert choice == PrefillChoice("b", PrefillReason.PREFIX_AFFINITY, num_cached_blocks=4)


def test_prefill_affinity_allows_exactly_the_configured_imbalance() -> None:
    replicas = [prefill("a", 200), prefill("b", 1200)]
    choice = choose_prefill_replica(replicas, HASHES, index_with("b", 6), CONFIG)
    assert choice.replica_id == "b" and choice.reason is PrefillReason.PREFIX_AFFINITY


def test_prefill_falls_back_when_the_affine_replica_is_overloaded() -> None:
    replicas = [prefill("a", 200), prefill("b", 1201), prefill("c", 300)]
    choice = choose_prefill_replica(replicas, HASHES, index_with("b", 6), CONFIG)
    assert choice == PrefillChoice("a", PrefillReason.LEAST_PENDING)


def test_prefill_falls_back_when_the_affine_replica_is_unhealthy() -> None:
    replicas = [prefill("a", 50), prefill("b", 0, is_healthy=False), prefill("c", 10)]
    choice = choose_prefill_replica(replicas, HASHES, index_with("b", 6), CONFIG)
    assert choice == PrefillChoice("c", PrefillReason.LEAST_PENDING)


def test_prefill_ignores_a_match_too_short_to_matter() -> None:
    replicas = [prefill("a", 0), prefill("b", 10)]
    assert choose_prefill_replica(replicas, HASHES, index_with("b", 1), CONFIG).replica_id == "a"
    assert choose_prefill_replica(replicas, HASHES, index_with("b", 2), CONFIG).replica_id == "b"


def test_prefill_uses_a_shorter_match_on_a_healthy_replica() -> None:
    index = index_with("a", 3)
    index.record(HASHES, "b")
    index.record(HASHES[:3], "a")  # a owns 0..2 again, b still owns 3..5
    replicas = [prefill("a", 900), prefill("b", 0, is_healthy=False), prefill("c", 0)]
    choice = choose_prefill_replica(replicas, HASHES, index, CONFIG)
    assert choice == PrefillChoice("a", PrefillReason.PREFIX_AFFINITY, num_cached_blocks=3)


def test_prefill_least_pending_ties_go_to_the_smallest_id() -> None:
    replicas = [prefill("c", 5), prefill("b", 5), prefill("d", 7)]
    empty = PrefixIndex(ttl_seconds=60, clock=lambda: 0.0)
    assert choose_prefill_replica(replicas, HASHES, empty) == PrefillChoice(
        "b", PrefillReason.LEAST_PENDING
    )


def test_prefill_least_pending_ties_go_to_the_fewest_sequences_first() -> None:
    """Two colocated engines between load reports: no prompt pending on either, one decoding
    three streams. The idle one gets the request, whatever the ids."""
    replicas = [prefill("a", 0, seqs=3), prefill("b", 0, seqs=0)]
    empty = PrefixIndex(ttl_seconds=60, clock=lambda: 0.0)
    assert choose_prefill_replica(replicas, HASHES, empty) == PrefillChoice(
        "b", PrefillReason.LEAST_PENDING
    )
    # Pending prompt tokens still come first: a prefill queue delays the first token most.
    replicas = [prefill("a", 0, seqs=3), prefill("b", 64, seqs=0)]
    assert choose_prefill_replica(replicas, HASHES, empty).replica_id == "a"


def test_prefill_without_a_healthy_replica_says_so() -> None:
    choice = choose_prefill_replica([prefill("a", 0, is_healthy=False)], HASHES, index_with("a", 6))
    assert choice == PrefillChoice(None, PrefillReason.NO_HEALTHY_REPLICA)
    assert not choice.is_chosen
    assert choose_prefill_replica([], HASHES, index_with("a", 6)).replica_id is None


def test_decode_picks_most_free_blocks_then_fewest_running() -> None:
    replicas = [decode("a", 40, running=1), decode("b", 60, running=9), decode("c", 60, running=3)]
    assert choose_decode_replica(replicas, 10) == DecodeChoice("c", DecodeReason.MOST_FREE_BLOCKS)
    tied = [decode("b", 60, running=3, waiting=2), decode("a", 60, running=3, waiting=2)]
    assert choose_decode_replica(tied, 10).replica_id == "a"
    by_waiting = [decode("a", 60, running=3, waiting=4), decode("b", 60, running=3, waiting=1)]
    assert choose_decode_replica(by_waiting, 10).replica_id == "b"
    running_first = [decode("a", 60, running=2, waiting=9), decode("b", 60, running=3)]
    assert choose_decode_replica(running_first, 10).replica_id == "a"


def test_decode_skips_replicas_that_do_not_fit_or_are_unhealthy() -> None:
    replicas = [decode("a", 99, is_healthy=False), decode("b", 30), decode("c", 31)]
    assert choose_decode_replica(replicas, 31).replica_id == "c"


def test_decode_reports_when_nothing_fits() -> None:
    replicas = [decode("a", 5, total=50), decode("b", 9, total=100)]
    assert choose_decode_replica(replicas, 10) == DecodeChoice(None, DecodeReason.NO_ROOM_NOW)
    assert choose_decode_replica(replicas, 101) == DecodeChoice(None, DecodeReason.NEVER_FITS)
    only_sick_is_big = [decode("a", 5, total=50), decode("b", 200, total=200, is_healthy=False)]
    assert choose_decode_replica(only_sick_is_big, 60).reason is DecodeReason.NEVER_FITS
    assert choose_decode_replica([], 1) == DecodeChoice(None, DecodeReason.NO_HEALTHY_REPLICA)


def test_bad_states_and_configs_raise() -> None:
    with pytest.raises(ValueError, match="num_free_blocks"):
        decode("a", 101, total=100)
    with pytest.raises(ValueError, match="num_pending_prefill_tokens"):
        prefill("a", -1)
    with pytest.raises(ValueError, match="num_blocks_needed"):
        choose_decode_replica([decode("a", 5)], 0)
    with pytest.raises(ValueError, match="min_match_blocks"):
        PrefillPolicyConfig(min_match_blocks=0)


# Ids come from list positions: a unique_by filter makes hypothesis retry draws for seconds.
prefill_states = st.lists(st.tuples(st.integers(0, 5000), st.booleans()), max_size=5).map(
    lambda rows: [prefill(f"r{i}", pending, is_healthy=ok) for i, (pending, ok) in enumerate(rows)]
)
decode_states = st.lists(
    st.tuples(st.integers(0, 64), st.integers(0, 64), st.integers(0, 10), st.booleans()),
    max_size=4,
).map(
    lambda rows: [
        decode(f"r{i}", total - min(used, total), total=total, running=running, is_healthy=ok)
        for i, (total, used, running, ok) in enumerate(rows)
    ]
)


@settings(max_examples=100, deadline=None)
@given(
    replicas=prefill_states,
    owner=st.sampled_from(["r0", "r1", "r2", "r3", "gone"]),
    num_blocks=st.integers(0, len(HASHES)),
)
def test_chosen_prefill_replica_is_healthy_and_never_too_overloaded(
    replicas: list[PrefillReplicaState], owner: str, num_blocks: int
) -> None:
    choice = choose_prefill_replica(replicas, HASHES, index_with(owner, num_blocks), CONFIG)
    healthy = {r.replica_id: r.num_pending_prefill_tokens for r in replicas if r.is_healthy}
    if not healthy:
        assert choice.reason is PrefillReason.NO_HEALTHY_REPLICA
        return
    assert choice.replica_id in healthy
    assert healthy[choice.replica_id] <= min(healthy.values()) + CONFIG.max_imbalance_tokens
    if choice.reason is PrefillReason.LEAST_PENDING:
        assert healthy[choice.replica_id] == min(healthy.values())


@settings(max_examples=100, deadline=None)
@given(
    replicas=decode_states,
    needed=st.integers(1, 70),
)
def test_chosen_decode_replica_is_healthy_and_fits(
    replicas: list[DecodeReplicaState], needed: int
) -> None:
    choice = choose_decode_replica(replicas, needed)
    fitting = [r for r in replicas if r.is_healthy and r.num_free_blocks >= needed]
    assert choice.is_chosen == bool(fitting)
    if fitting:
        chosen = next(r for r in fitting if r.replica_id == choice.replica_id)
        assert chosen.num_free_blocks == max(r.num_free_blocks for r in fitting)
