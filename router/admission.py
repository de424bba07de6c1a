"""Admission control for one router replica: bounded in-flight requests and queued prompt
tokens. Pure functions over an immutable `AdmissionState`; the router shell keeps the current
state and swaps it on each call.

Lifecycle of one request, each step returning a new state:

    admit(state, limits, n)  -> Admitted(state, ticket) | Rejected(reason)   in flight +1, queued +n
    finish_prefill(state, t) -> (state, ticket)                                           queued -n
    release(state, ticket)   -> state           in flight -1, queued -n if prefill never finished

"Queued prompt tokens" are the prompt tokens admitted but not yet prefilled: the prefill work
this router has promised. A prompt larger than the whole token budget is still admitted when
nothing is queued, so it runs alone instead of never; validation already bounds it by the
model's context. A rejection maps to RESOURCE_EXHAUSTED / HTTP 429 at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import NamedTuple


@dataclass(frozen=True)
class AdmissionLimits:
    max_in_flight: int = 256
    max_queued_prompt_tokens: int = 65_536

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_queued_prompt_tokens < 1:
            raise ValueError(
                f"max_queued_prompt_tokens must be >= 1, got {self.max_queued_prompt_tokens}"
            )


@dataclass(frozen=True)
class AdmissionState:
    num_in_flight: int = 0
    num_queued_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        # Negative counts mean a ticket was released twice: a router bug, not user input.
        if self.num_in_flight < 0 or self.num_queued_prompt_tokens < 0:
            raise RuntimeError(f"admission counts went negative: {self}")


@dataclass(frozen=True)
class Ticket:
    """What one admitted request holds; hand it back to `finish_prefill` and `release`."""

    num_prompt_tokens: int
    is_prefilled: bool = False

    @property
    def num_queued_tokens(self) -> int:
        return 0 if self.is_prefilled else self.num_prompt_tokens


class RejectReason(StrEnum):
    TOO_MANY_IN_FLIGHT = "too_many_in_flight"
    TOO_MANY_QUEUED_TOKENS = "too_many_queued_tokens"


class Admitted(NamedTuple):
    state: AdmissionState
    ticket: Ticket


class Rejected(NamedTuple):
    reason: RejectReason
    message: str


def admit(
    state: AdmissionState, limits: AdmissionLimits, num_prompt_tokens: int
) -> Admitted | Rejected:
    if num_prompt_tokens < 1:
        raise ValueError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
    if state.num_in_flight >= limits.max_in_flight:
        return Rejected(
            RejectReason.TOO_MANY_IN_FLIGHT,
            f"{state.num_in_flight} requests in flight, the limit is {limits.max_in_flight}",
        )
    queued = state.num_queued_prompt_tokens + num_prompt_tokens
    if state.num_queued_prompt_tokens > 0 and queued > limits.max_queued_prompt_tokens:
        return Rejected(
            RejectReason.TOO_MANY_QUEUED_TOKENS,
            f"{state.num_queued_prompt_tokens} prompt tokens queued; {num_prompt_tokens} more "
            f"would pass the limit of {limits.max_queued_prompt_tokens}",
        )
    new_state = AdmissionState(state.num_in_flight + 1, queued)
    return Admitted(new_state, Ticket(num_prompt_tokens))


def finish_prefill(state: AdmissionState, ticket: Ticket) -> tuple[AdmissionState, Ticket]:
    """The prompt is prefilled: its tokens leave the queue; the request stays in flight."""
    if ticket.is_prefilled:
        return state, ticket
    new_state = replace(
        state, num_queued_prompt_tokens=state.num_queued_prompt_tokens - ticket.num_prompt_tokens
    )
    return new_state, replace(ticket, is_prefilled=True)


def release(state: AdmissionState, ticket: Ticket) -> AdmissionState:
    """The request is done (finished, cancelled or failed): everything its ticket holds goes."""
    return AdmissionState(
        state.num_in_flight - 1, state.num_queued_prompt_tokens - ticket.num_queued_tokens
    )
