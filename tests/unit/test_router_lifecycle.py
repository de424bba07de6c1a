"""`generate_disaggregated` over in-process fake pools: the event stream, that every handoff
prefill makes ends decoded or released exactly once, whatever stage a cancel, an error or an
early finish lands in, and that a failed stream moves on with nothing repeated or lost.
Milliseconds each; the engine tests run the same code on vLLM."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine.messages import KVTransferError, TokenEvent
from engine.params import StructuredOutput
from router import lifecycle
from router.lifecycle import StreamInterrupted, generate_colocated, generate_disaggregated
from tests.fakes import FakeColocated, FakeDecode, FakePrefill, ids, make_request


async def collect(events: AsyncIterator[TokenEvent]) -> list[TokenEvent]:
    return [event async for event in events]


def tokens(events: list[TokenEvent]) -> tuple[int, ...]:
    return tuple(token for event in events for token in event.token_ids)


async def test_first_token_then_decode_start_then_the_decoded_tokens() -> None:
    prefill, decode = FakePrefill("W"), FakeDecode("orld", "length")
    events = await collect(generate_disaggregated(prefill, decode, make_request()))
    first, start, *decoded = events
    assert (first.token_ids, first.is_first, first.finish_reason) == (ids("W"), True, None)
    assert first.prefill_seconds == 0.001
    assert (start.token_ids, start.is_decode_start) == ((), True)
    assert tokens(decoded) == ids("orld") and decoded[-1].finish_reason == "length"
    assert not any(e.is_first or e.is_decode_start for e in decoded)
    (handoff,) = prefill.handoffs
    assert decode.decoded == [handoff] and decode.released == []


async def test_a_sampled_request_reaches_both_pools_with_one_pinned_seed() -> None:
    prefill, decode = FakePrefill(), FakeDecode()
    await collect(generate_disaggregated(prefill, decode, make_request(temperature=0.8)))
    (sent_to_prefill,), (sent_to_decode,) = prefill.requests, decode.requests
    assert sent_to_prefill.params.seed is not None
    assert sent_to_prefill == sent_to_decode


async def test_finishing_at_the_first_token_releases_the_handoff() -> None:
    prefill, decode = FakePrefill("W", finish_reason="stop"), FakeDecode()
    events = await collect(generate_disaggregated(prefill, decode, make_request()))
    assert [(e.token_ids, e.finish_reason) for e in events] == [(ids("W"), "stop")]
    assert decode.decoded == [] and decode.released == prefill.handoffs


@pytest.mark.parametrize("abort_fails_prefill", [False, True])
async def test_a_cancel_during_prefill_gives_back_what_prefill_made(
    abort_fails_prefill: bool,
) -> None:
    gate = asyncio.Event()
    prefill = FakePrefill(gate=gate, abort_fails_prefill=abort_fails_prefill)
    decode = FakeDecode()
    task = asyncio.ensure_future(collect(generate_disaggregated(prefill, decode, make_request())))
    await prefill.started.wait()
    task.cancel()
    await asyncio.sleep(0)  # the cancel lands: the lifecycle aborts and waits for prefill
    assert prefill.aborted == ["req-1"]
    gate.set()  # the engine finishes (or fails) the request the cancel could not stop
    with pytest.raises(asyncio.CancelledError):
        await task
    assert decode.decoded == []
    # A handoff made after the cancel is released once; an aborted prefill made none.
    assert decode.released == prefill.handoffs
    assert len(prefill.handoffs) == (0 if abort_fails_prefill else 1)


async def test_a_prefill_still_running_after_a_cancel_is_waited_for_only_so_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifecycle, "GIVE_BACK_PREFILL_TIMEOUT_S", 0.05)
    prefill, decode = FakePrefill(gate=asyncio.Event()), FakeDecode()  # the prefill never ends
    task = asyncio.ensure_future(collect(generate_disaggregated(prefill, decode, make_request())))
    await prefill.started.wait()
    task.cancel()
    # Bounded: a TimeoutError here is a cancel that waits on the prefill for good.
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert prefill.aborted == ["req-1"]
    assert prefill.handoffs == [] and decode.released == []


async def test_a_release_that_never_answers_holds_a_cancel_only_so_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifecycle, "RELEASE_TIMEOUT_S", 0.05)
    prefill = FakePrefill()
    decode = FakeDecode("orld", release_is_idempotent=True, release_gate=asyncio.Event())
    events = generate_disaggregated(prefill, decode, make_request())
    received = [await anext(events) for _ in range(3)]  # first, decode start, "o"
    await asyncio.wait_for(events.aclose(), 5)  # the client went away; the release hangs
    assert tokens(received) == ids("Wo")
    assert decode.released == prefill.handoffs  # asked once, never answered: the lease expires


@pytest.mark.parametrize("stop_after", ["first", "decode_start"])
async def test_stopping_before_decode_releases_the_handoff(stop_after: str) -> None:
    prefill, decode = FakePrefill(), FakeDecode()
    events = generate_disaggregated(prefill, decode, make_request())
    first = await anext(events)
    assert first.is_first
    if stop_after == "decode_start":
        assert (await anext(events)).is_decode_start
    await events.aclose()  # the client went away
    assert decode.decoded == [] and decode.released == prefill.handoffs


@pytest.mark.parametrize("idempotent", [True, False])
async def test_a_cancel_mid_decode_releases_again_only_where_that_is_safe(idempotent: bool) -> None:
    gate = asyncio.Event()
    prefill = FakePrefill()
    decode = FakeDecode("orld", release_is_idempotent=idempotent, gate=gate, gate_at=2)
    received: list[TokenEvent] = []

    async def consume() -> None:
        async for event in generate_disaggregated(prefill, decode, make_request()):
            received.append(event)

    task = asyncio.ensure_future(consume())
    await decode.waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tokens(received) == ids("W") + ids("or")
    assert decode.decoded == prefill.handoffs
    # Non-idempotent backends: the decode engine owns the lease once it has the request.
    assert decode.released == (prefill.handoffs if idempotent else [])


@pytest.mark.parametrize("idempotent", [True, False])
async def test_a_client_gone_mid_decode_is_a_cancel_too(idempotent: bool) -> None:
    prefill, decode = FakePrefill(), FakeDecode("orld", release_is_idempotent=idempotent)
    events = generate_disaggregated(prefill, decode, make_request())
    received = [await anext(events) for _ in range(3)]  # first, decode start, "o"
    await events.aclose()
    assert tokens(received) == ids("Wo")
    assert decode.released == (prefill.handoffs if idempotent else [])


async def test_a_prefill_error_reaches_the_caller_with_nothing_to_release() -> None:
    prefill = FakePrefill(error=ValueError("prompt has 9000 tokens"))
    decode = FakeDecode()
    with pytest.raises(ValueError, match="9000 tokens"):
        await collect(generate_disaggregated(prefill, decode, make_request()))
    assert prefill.handoffs == [] and decode.decoded == [] and decode.released == []


@pytest.mark.parametrize("idempotent", [True, False])
async def test_a_decode_failure_moves_the_stream_with_no_token_repeated_or_lost(
    idempotent: bool,
) -> None:
    prefill = FakePrefill()
    decode = FakeDecode("orld", release_is_idempotent=idempotent, error_at=1, fail_times=1)
    failures: list[tuple[str | None, bool]] = []
    stream = generate_disaggregated(
        prefill, decode, make_request(max_tokens=5), on_failure=lambda *f: failures.append(f)
    )
    events = await collect(stream)
    assert tokens(events) == ids("World")
    assert [e.is_first for e in events].count(True) == 1 and events[0].is_first
    assert [e.is_decode_start for e in events].count(True) == 1
    assert events[-1].finish_reason == "length"
    # Moved with the prompt plus the two tokens delivered, under a new id, for the rest.
    moved = prefill.requests[1]
    assert moved.prompt_token_ids == ids("hello") + ids("Wo")
    assert (moved.request_id, moved.params.max_tokens) == ("req-1~1", 3)
    assert decode.requests[1] == moved
    # Both pools are told which replica failed the request.
    assert prefill.avoided == decode.avoided == [frozenset(), frozenset({"decode-0"})]
    assert failures == [("decode-0", True)]
    first_handoff, moved_handoff = prefill.handoffs
    assert decode.decoded == [first_handoff, moved_handoff]
    assert decode.released == ([first_handoff] if idempotent else [])


async def test_a_failed_kv_load_is_no_answer_but_a_failure_that_moves_the_stream() -> None:
    """`failure_policy: fail`: vLLM ends the request with finish reason "error"."""
    prefill = FakePrefill()
    decode = FakeDecode("orld", finish_reason="error")  # on every decode's last event
    events = await collect(generate_disaggregated(prefill, decode, make_request(max_tokens=5)))
    assert tokens(events) == ids("World")  # "d" from the moved request's prefill
    assert events[-1].finish_reason == "length"
    assert all(e.finish_reason != "error" for e in events)


async def test_past_its_migrations_a_failing_stream_is_interrupted_naming_what_it_sent() -> None:
    prefill = FakePrefill(then="orld and more")
    decode = FakeDecode("orld and more", error_at=1)  # fails on every replica
    received: list[TokenEvent] = []
    failures: list[tuple[str | None, bool]] = []
    stream = generate_disaggregated(
        prefill, decode, make_request(max_tokens=14), on_failure=lambda *f: failures.append(f)
    )
    with pytest.raises(StreamInterrupted, match="after 6 tokens were delivered") as raised:
        async for event in stream:
            received.append(event)
    assert tokens(received) == ids("World ")
    assert (raised.value.num_delivered, raised.value.num_attempts) == (6, 3)
    assert isinstance(raised.value.__cause__, KVTransferError)
    assert decode.avoided == [
        frozenset(),
        frozenset({"decode-0"}),
        frozenset({"decode-0", "decode-1"}),
    ]
    assert failures == [("decode-0", True), ("decode-1", True), ("decode-2", False)]


async def test_no_migrations_allowed_means_the_first_failure_interrupts() -> None:
    prefill, decode = FakePrefill(), FakeDecode("orld", error_at=1, fail_times=1)
    with pytest.raises(StreamInterrupted, match="after 2 tokens"):
        await collect(generate_disaggregated(prefill, decode, make_request(), max_migrations=0))
    assert len(prefill.requests) == 1


async def test_a_prefill_failure_before_the_first_token_is_retried_as_it_was() -> None:
    prefill = FakePrefill(error=RuntimeError("the prefill replica died"), fail_times=1)
    decode = FakeDecode()
    events = await collect(generate_disaggregated(prefill, decode, make_request(max_tokens=5)))
    assert tokens(events) == ids("World") and events[0].is_first
    assert [r.request_id for r in prefill.requests] == ["req-1", "req-1~1"]
    assert prefill.requests[1].prompt_token_ids == ids("hello")
    assert prefill.requests[1].params.max_tokens == 5


async def test_when_no_prefill_replica_can_a_decode_replica_prefills_for_itself() -> None:
    prefill = FakePrefill(error=RuntimeError("the prefill replica died"))
    decode = FakeDecode()
    events = await collect(generate_disaggregated(prefill, decode, make_request(max_tokens=5)))
    assert tokens(events) == ids("World") and events[0].is_first
    assert events[0].replica_id == "decode-local-0"
    assert [r.request_id for r in prefill.requests] == ["req-1", "req-1~1"]
    assert [r.request_id for r in decode.local] == ["req-1~2"]
    assert decode.decoded == [] and not any(e.is_decode_start for e in events)


async def test_a_last_attempt_after_a_prefill_failure_goes_to_a_decode_replica() -> None:
    prefill = FakePrefill(error=RuntimeError("the prefill replica died"))
    decode = FakeDecode()
    stream = generate_disaggregated(prefill, decode, make_request(max_tokens=5), max_migrations=1)
    assert tokens(await collect(stream)) == ids("World")
    assert [r.request_id for r in prefill.requests] == ["req-1"]
    assert [r.request_id for r in decode.local] == ["req-1~1"]


async def test_a_decode_stream_that_ends_unfinished_is_released_where_safe() -> None:
    prefill = FakePrefill()
    decode = FakeDecode("orld", finish_reason=None, release_is_idempotent=True)
    events = await collect(generate_disaggregated(prefill, decode, make_request()))
    assert events[-1].finish_reason is None
    assert decode.released == prefill.handoffs


async def test_a_finished_decode_is_never_released_again() -> None:
    prefill, decode = FakePrefill(), FakeDecode(release_is_idempotent=True)
    await collect(generate_disaggregated(prefill, decode, make_request()))
    assert decode.decoded == prefill.handoffs and decode.released == []


async def test_a_colocated_stream_moves_to_another_engine_too() -> None:
    engines = FakeColocated("World", error_at=2, fail_times=1)
    failures: list[tuple[str | None, bool]] = []
    stream = generate_colocated(
        engines, make_request(max_tokens=5), on_failure=lambda *f: failures.append(f)
    )
    events = await collect(stream)
    assert tokens(events) == ids("World")
    assert [e.is_first for e in events] == [True, False, False, False, False]
    assert events[-1].finish_reason == "length"
    moved = engines.requests[1]
    assert moved.prompt_token_ids == ids("hello") + ids("Wo")
    assert (moved.request_id, moved.params.max_tokens) == ("req-1~1", 3)
    assert engines.avoided == [frozenset(), frozenset({"engine-0"})]
    assert failures == [("engine-0", True)]


async def test_a_colocated_stream_failing_everywhere_is_interrupted() -> None:
    engines = FakeColocated("World", error_at=1)
    with pytest.raises(StreamInterrupted, match="after 3 tokens were delivered"):
        await collect(generate_colocated(engines, make_request(max_tokens=5)))
    assert len(engines.requests) == 3


async def test_a_replica_failing_before_its_first_token_is_avoided_by_the_name_it_gives() -> None:
    """A decode replica whose engine died fails before it answers: the lifecycle has not heard
    from it, so the ReplicaFailure it raises names it."""
    prefill = FakePrefill()
    decode = FakeDecode("orld", error_at=0, fail_times=1, names_replica=True)
    failures: list[tuple[str | None, bool]] = []
    stream = generate_disaggregated(
        prefill, decode, make_request(max_tokens=5), on_failure=lambda *f: failures.append(f)
    )
    assert tokens(await collect(stream)) == ids("World")
    assert decode.avoided == [frozenset(), frozenset({"decode-0"})]
    assert failures == [("decode-0", True)]


async def test_a_short_prompt_the_router_keeps_local_is_prefilled_on_decode_alone() -> None:
    from router.policy import LocalPrefill

    decisions: list[str] = []
    local = LocalPrefill(max_tokens=len(ids("hello")), on_decision=decisions.append)
    prefill, decode = FakePrefill(), FakeDecode()
    events = await collect(
        generate_disaggregated(
            prefill, decode, make_request(max_tokens=5), prefill_locally=local.decide
        )
    )
    assert tokens(events) == ids("World") and events[0].is_first
    assert prefill.requests == [] and decode.decoded == [] and len(decode.local) == 1
    longer = make_request(max_tokens=5, prompt="hello there")
    events = await collect(
        generate_disaggregated(prefill, decode, longer, prefill_locally=local.decide)
    )
    assert tokens(events) == ids("World") and len(prefill.requests) == 1
    assert decisions == ["local", "remote"]


async def test_a_constrained_stream_is_not_moved_once_it_has_tokens() -> None:
    """A structured-output constraint starts at the answer's first token: a stream cut after
    some tokens is interrupted, not resumed from a longer prompt. Before its first token it is
    retried as any request is."""
    request = make_request(max_tokens=5, structured=StructuredOutput("regex", "[A-z]+"))
    engines = FakeColocated("World", error_at=2, fail_times=1)
    with pytest.raises(StreamInterrupted, match="after 2 tokens were delivered"):
        await collect(generate_colocated(engines, request))
    assert len(engines.requests) == 1
    prefill = FakePrefill(error=RuntimeError("the prefill replica died"), fail_times=1)
    events = await collect(generate_disaggregated(prefill, FakeDecode(), request))
    assert tokens(events) == ids("World")
    assert [r.params.structured for r in prefill.requests] == [request.params.structured] * 2
