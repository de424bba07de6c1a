"""Admission control: bounded in-flight requests and queued prompt tokens (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.admission import (
    AdmissionLimits,
    AdmissionState,
    Admitted,
    Rejected,
    RejectReason,
    Ticket,
    admit,
    finish_prefill,
    release,
)

LIMITS = AdmissionLimits(max_in_flight=3, max_queued_prompt_tokens=1000)
EMPTY = AdmissionState()


def admitted(state: AdmissionState, num_prompt_tokens: int) -> tuple[AdmissionState, Ticket]:
    result = admit(state, LIMITS, num_prompt_tokens)
    assert isinstance(result, Admitted), result
    return result.state, result.ticket


def test_admit_counts_the_request_and_its_prompt_tokens() -> None:
    assert admit(EMPTY, LIMITS, 400) == Admitted(AdmissionState(1, 400), Ticket(400))


def test_rejects_at_the_in_flight_bound_and_admits_after_release() -> None:
    state = EMPTY
    tickets = []
    for _ in range(3):
        state, ticket = admitted(state, 10)
        state, ticket = finish_prefill(state, ticket)
        tickets.append(ticket)
    assert state == AdmissionState(3, 0)
    result = admit(state, LIMITS, 10)
    assert isinstance(result, Rejected)
    assert result.reason is RejectReason.TOO_MANY_IN_FLIGHT
    assert "3 requests in flight, the limit is 3" in result.message
    state = release(state, tickets[0])
    assert state == AdmissionState(2, 0)
    assert admit(state, LIMITS, 10) == Admitted(AdmissionState(3, 10), Ticket(10))


def test_rejects_at_the_token_bound_and_admits_after_prefill() -> None:
    state, first = admitted(EMPTY, 600)
    state, _ = admitted(state, 400)  # exactly at the bound
    assert state == AdmissionState(2, 1000)
    result = admit(state, LIMITS, 1)
    assert isinstance(result, Rejected)
    assert result.reason is RejectReason.TOO_MANY_QUEUED_TOKENS
    assert "1000 prompt tokens queued; 1 more would pass the limit of 1000" in result.message
    state, first = finish_prefill(state, first)
    assert state == AdmissionState(2, 400)
    assert isinstance(admit(state, LIMITS, 600), Admitted)
    assert isinstance(admit(state, LIMITS, 601), Rejected)


def test_release_before_prefill_returns_the_tokens_too() -> None:
    state, ticket = admitted(EMPTY, 700)
    assert release(state, ticket) == EMPTY
    state, ticket = admitted(EMPTY, 700)
    state, ticket = finish_prefill(state, ticket)
    state, ticket = finish_prefill(state, ticket)  # a second call changes nothing
    assert state == AdmissionState(1, 0)
    assert release(state, ticket) == EMPTY


def test_an_oversized_prompt_runs_alone() -> None:
    state, ticket = admitted(EMPTY, 5000)
    assert state == AdmissionState(1, 5000)
    assert isinstance(admit(state, LIMITS, 1), Rejected)
    state, _ = finish_prefill(state, ticket)
    assert isinstance(admit(state, LIMITS, 5000), Admitted)


def test_bad_inputs_and_double_release_raise() -> None:
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        admit(EMPTY, LIMITS, 0)
    with pytest.raises(ValueError, match="max_in_flight"):
        AdmissionLimits(max_in_flight=0)
    state, ticket = admitted(EMPTY, 10)
    state = release(state, ticket)
    with pytest.raises(RuntimeError, match="negative"):
        release(state, ticket)


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["admit", "prefill", "release"]), st.integers(1, 1500)),
        max_size=60,
    )
)
def test_admission_never_exceeds_its_bounds(ops: list[tuple[str, int]]) -> None:
    state = EMPTY
    live: list[Ticket] = []
    for op, value in ops:
        if op == "admit":
            result = admit(state, LIMITS, value)
            if isinstance(result, Admitted):
                state = result.state
                live.append(result.ticket)
        elif live:
            i = value % len(live)
            if op == "prefill":
                state, live[i] = finish_prefill(state, live[i])
            else:
                state = release(state, live.pop(i))
        queued = [t.num_queued_tokens for t in live if t.num_queued_tokens]
        assert state.num_in_flight == len(live) <= LIMITS.max_in_flight
        assert state.num_queued_prompt_tokens == sum(queued)
        # Over the token bound only as the oversized prompt that runs alone.
        assert state.num_queued_prompt_tokens <= LIMITS.max_queued_prompt_tokens or len(queued) == 1
    for ticket in live:
        state = release(state, ticket)
    assert state == EMPTY
