"""engine/intervals.py: tokens merged N to a message after a stream's first, markers at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine.intervals import in_intervals
from engine.messages import TokenEvent


async def _events(*events: TokenEvent) -> AsyncIterator[TokenEvent]:
    for event in events:
        yield event


def _run(interval: int, *events: TokenEvent) -> list[TokenEvent]:
    async def collect() -> list[TokenEvent]:
        return [e async for e in in_intervals(_events(*events), interval)]

    return asyncio.run(collect())


def _tokens(n: int, start: int = 0, finish: str | None = None) -> list[TokenEvent]:
    out = [TokenEvent((start + i,), None) for i in range(n)]
    if finish is not None:
        out[-1] = TokenEvent((start + n - 1,), finish)
    return out


def test_interval_one_passes_every_event() -> None:
    events = _tokens(5, finish="length")
    assert _run(1, *events) == events


def test_a_colocated_stream_sends_the_first_token_then_groups_of_n_and_flushes_at_finish() -> None:
    first = TokenEvent((0,), None, is_first=True, prefill_seconds=0.2, replica_id="engine-a")
    out = _run(4, first, *_tokens(9, start=1, finish="stop"))
    assert [e.token_ids for e in out] == [(0,), (1, 2, 3, 4), (5, 6, 7, 8), (9,)]
    assert out[0] is first and out[-1].finish_reason == "stop"
    assert [e.finish_reason for e in out[:-1]] == [None, None, None]


def test_a_decode_stream_names_its_replica_in_its_first_event_which_goes_at_once() -> None:
    head = TokenEvent((10,), None, replica_id="decode-b")
    out = _run(3, head, *_tokens(4, start=11, finish="length"))
    assert [(e.token_ids, e.replica_id) for e in out] == [
        ((10,), "decode-b"),
        ((11, 12, 13), ""),
        ((14,), ""),
    ]


def test_markers_flush_what_is_held_and_logprobs_follow_their_tokens() -> None:
    start = TokenEvent((), None, is_decode_start=True)
    first = TokenEvent((0,), None, is_first=True, logprobs=((),))
    tokens = [TokenEvent((i,), None, logprobs=((),)) for i in (1, 2)]
    out = _run(8, first, *tokens, start, TokenEvent((3,), "stop", logprobs=((),)))
    assert [(e.token_ids, e.is_decode_start) for e in out] == [
        ((0,), False),
        ((1, 2), False),  # flushed by the marker
        ((), True),
        ((3,), False),
    ]
    assert out[1].logprobs is not None and len(out[1].logprobs) == 2


def test_a_stream_that_ends_without_a_finish_still_hands_over_what_was_held() -> None:
    out = _run(4, *_tokens(3))
    assert [e.token_ids for e in out] == [(0,), (1, 2)]


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval"):
        _run(0, *_tokens(1))
