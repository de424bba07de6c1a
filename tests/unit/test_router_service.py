"""`RouterService` over in-process fake pools and a one-token-per-character tokenizer: body to
validated, tokenized, admitted request to chunks of text, with its timings, usage, admission
bookkeeping, `on_finish` outcome and handoff ownership checked at each way a request can end.
Milliseconds each; tests/e2e runs the same service behind Serve, gRPC and HTTP."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from router.admission import AdmissionLimits
from router.lifecycle import StreamInterrupted
from router.service import Overloaded, RouterService, StreamChunk
from router.timings import RequestTimings
from router.validation import InvalidRequest, RequestLimits
from tests.fakes import FakeDecode, FakeEngines, FakePrefill, FakeTokenizer, ids

MODEL = "fake"
Finish = tuple[str, RequestTimings | None, int]


def make_service(
    prefill: FakePrefill | None = None,
    decode: FakeDecode | None = None,
    *,
    max_in_flight: int = 8,
    max_model_len: int = 64,
) -> tuple[RouterService, list[Finish]]:
    finished: list[Finish] = []
    service = RouterService(
        FakeTokenizer(),
        RequestLimits(served_models=frozenset({MODEL}), default_model=MODEL),
        AdmissionLimits(max_in_flight=max_in_flight, max_queued_prompt_tokens=1024),
        max_model_len,
        FakeEngines(prefill or FakePrefill(), decode or FakeDecode()),
        on_finish=lambda outcome, timings, usage: finished.append(
            (outcome, timings, usage.completion_tokens)
        ),
    )
    return service, finished


async def run(service: RouterService, body: dict[str, Any]) -> list[StreamChunk]:
    return [chunk async for chunk in service.stream(service.prepare(body, "req-1"))]


def engines_of(service: RouterService) -> FakeEngines:
    engines = service.engines
    assert isinstance(engines, FakeEngines)
    return engines


async def test_a_request_streams_text_with_timings_and_usage_on_the_last_chunk() -> None:
    service, finished = make_service(FakePrefill("W"), FakeDecode("orld", "length"))
    chunks = await run(service, {"prompt": "Hello", "max_tokens": 5})
    assert [c.text for c in chunks] == ["W", "o", "r", "l", "d"]
    assert [c.token_ids for c in chunks] == [(t,) for t in ids("World")]
    assert [c.finish_reason for c in chunks] == [None] * 4 + ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 5)
    first, last = chunks[0].timings, chunks[-1].timings
    assert first.ttft_s > 0 and first.prefill_s == pytest.approx(0.001, abs=1e-3)
    assert first.decode_start_s == 0  # the first token leaves before decode is called
    assert last.decode_start_s >= first.ttft_s and last.e2e_s >= last.decode_start_s
    assert last.mean_tpot_s > 0
    assert finished == [("ok", last, 5)]
    assert service.num_in_flight == 0
    engines = engines_of(service)
    assert engines.decode.decoded == engines.prefill.handoffs and engines.decode.released == []


async def test_prepare_tokenizes_prompts_and_chats_and_names_bad_fields() -> None:
    service, _ = make_service()
    prepared = service.prepare({"prompt": "Hi"}, "req-7")
    assert prepared.request.request_id == "req-7"
    assert prepared.request.prompt_token_ids == ids("Hi")
    chat = service.prepare({"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.request.prompt_token_ids == ids("<user>Hi<assistant>")
    assert chat.request.request_id.startswith("req-")
    with pytest.raises(InvalidRequest) as error:
        service.prepare({"prompt": "x" * 64})  # the context is 64 tokens
    assert error.value.field == "prompt"
    with pytest.raises(InvalidRequest, match="max_tokens"):
        service.prepare({"prompt": "Hi", "max_tokens": 0})


async def test_chat_needs_a_chat_template() -> None:
    service, _ = make_service()
    service.tokenizer.chat_template = None
    with pytest.raises(InvalidRequest) as error:
        service.prepare({"messages": [{"role": "user", "content": "Hi"}]})
    assert error.value.field == "messages"


async def test_a_full_router_refuses_with_overloaded_and_releases_nothing() -> None:
    gate = asyncio.Event()
    prefill = FakePrefill(gate=gate)
    service, finished = make_service(prefill, max_in_flight=1)
    first = asyncio.ensure_future(run(service, {"prompt": "one"}))
    await prefill.started.wait()
    with pytest.raises(Overloaded, match="at capacity"):
        await run(service, {"prompt": "two"})
    assert len(prefill.requests) == 1 and engines_of(service).decode.released == []
    assert service.num_in_flight == 1 and finished == []  # a refusal is not a request
    gate.set()
    assert len(await first) == 5
    assert [outcome for outcome, _, _ in finished] == ["ok"]
    assert service.num_in_flight == 0


async def test_a_cancel_during_prefill_frees_the_slot_and_the_handoff() -> None:
    gate = asyncio.Event()
    prefill = FakePrefill(gate=gate)
    service, finished = make_service(prefill)
    task = asyncio.ensure_future(run(service, {"prompt": "hello"}))
    await prefill.started.wait()
    task.cancel()
    await asyncio.sleep(0)
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [("cancelled", None, 0)]
    assert service.num_in_flight == 0
    assert len(prefill.handoffs) == 1  # made after the cancel, and given back
    assert engines_of(service).decode.released == prefill.handoffs


async def test_a_client_gone_after_the_first_token_releases_the_handoff() -> None:
    service, finished = make_service()
    stream = service.stream(service.prepare({"prompt": "hello"}))
    first = await anext(stream)
    assert first.text == "W"
    await stream.aclose()
    assert finished == [("cancelled", None, 1)]
    engines = engines_of(service)
    assert engines.decode.decoded == [] and engines.decode.released == engines.prefill.handoffs
    assert service.num_in_flight == 0


@pytest.mark.parametrize("idempotent", [True, False])
async def test_a_cancel_mid_decode(idempotent: bool) -> None:
    gate = asyncio.Event()
    decode = FakeDecode("orld", release_is_idempotent=idempotent, gate=gate, gate_at=2)
    service, finished = make_service(FakePrefill(), decode)
    received: list[StreamChunk] = []

    async def consume() -> None:
        async for chunk in service.stream(service.prepare({"prompt": "hello"})):
            received.append(chunk)

    task = asyncio.ensure_future(consume())
    await decode.waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "".join(c.text for c in received) == "Wor"
    assert finished == [("cancelled", None, 3)]
    engines = engines_of(service)
    assert engines.decode.released == (engines.prefill.handoffs if idempotent else [])


async def test_a_prefill_error_is_the_callers_and_an_error_outcome() -> None:
    service, finished = make_service(FakePrefill(error=ValueError("prompt too long")))
    with pytest.raises(ValueError, match="prompt too long"):
        await run(service, {"prompt": "hello"})
    assert finished == [("error", None, 0)] and service.num_in_flight == 0


@pytest.mark.parametrize("idempotent", [True, False])
async def test_a_decode_failure_past_the_migrations_is_the_callers_and_an_error_outcome(
    idempotent: bool,
) -> None:
    decode = FakeDecode("orld", release_is_idempotent=idempotent, error_at=0)
    service, finished = make_service(FakePrefill(), decode)
    with pytest.raises(StreamInterrupted, match="after 3 tokens were delivered"):
        await run(service, {"prompt": "hello"})
    assert finished == [("error", None, 3)]
    engines = engines_of(service)
    assert engines.decode.released == (engines.prefill.handoffs if idempotent else [])


async def test_a_moved_stream_is_one_stream_to_the_caller() -> None:
    decode = FakeDecode("orld", error_at=1, fail_times=1)
    service, finished = make_service(FakePrefill(), decode)
    chunks = await run(service, {"prompt": "hello", "max_tokens": 5})
    assert "".join(c.text for c in chunks) == "World"
    assert [c.finish_reason for c in chunks] == [None] * 4 + ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert [(outcome, num) for outcome, _, num in finished] == [("ok", 5)]


async def test_engines_that_stop_without_a_finish_reason_are_an_error() -> None:
    service, finished = make_service(decode=FakeDecode("orld", finish_reason=None))
    with pytest.raises(RuntimeError, match="without a finish reason"):
        await run(service, {"prompt": "hello"})
    assert [outcome for outcome, _, _ in finished] == ["error"]


@pytest.mark.parametrize("idempotent", [True, False])
async def test_a_stop_string_ends_the_request_and_the_decode_stream(idempotent: bool) -> None:
    decode = FakeDecode("orld!!", release_is_idempotent=idempotent)
    service, finished = make_service(FakePrefill("W"), decode)
    chunks = await run(service, {"prompt": "hello", "stop": ["rl"]})
    assert "".join(c.text for c in chunks) == "Wo"
    assert chunks[-1].finish_reason == "stop"
    assert [outcome for outcome, _, _ in finished] == ["ok"]
    # The decode stream was cut short: released again only where that is safe.
    engines = engines_of(service)
    assert engines.decode.released == (engines.prefill.handoffs if idempotent else [])


async def test_finishing_at_the_first_token_never_calls_decode() -> None:
    service, finished = make_service(FakePrefill("W", finish_reason="stop"))
    chunks = await run(service, {"prompt": "hello"})
    assert [(c.text, c.finish_reason) for c in chunks] == [("W", "stop")]
    assert chunks[0].timings.decode_start_s == 0 and chunks[0].timings.kv_transfer_s == 0
    assert finished[0][0] == "ok" and finished[0][2] == 1
    engines = engines_of(service)
    assert engines.decode.decoded == [] and engines.decode.released == engines.prefill.handoffs


async def test_a_long_prompt_is_tokenized_off_the_event_loop() -> None:
    """prepare_async: a prompt (or chat) past INLINE_TOKENIZE_CHARS is tokenized in a worker
    thread while the loop keeps serving (a ticker runs through a 0.3 s tokenization); a short
    one on the loop itself."""
    import threading
    import time

    from router.service import INLINE_TOKENIZE_CHARS

    threads: list[threading.Thread] = []

    class SlowTokenizer(FakeTokenizer):
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            threads.append(threading.current_thread())
            if len(text) > INLINE_TOKENIZE_CHARS:
                time.sleep(0.3)  # holds whichever thread tokenizes
            return super().__call__(text, add_special_tokens)

    service, _ = make_service(max_model_len=3 * INLINE_TOKENIZE_CHARS)
    service.tokenizer = SlowTokenizer()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.ensure_future(ticker())
    try:
        short = await service.prepare_async({"prompt": "x" * INLINE_TOKENIZE_CHARS})
        assert threads[-1] is threading.current_thread()
        ticks = 0
        long = await service.prepare_async({"prompt": "y" * (INLINE_TOKENIZE_CHARS + 1)})
        assert threads[-1] is not threading.current_thread()
        assert ticks >= 5, ticks  # the loop ran while the prompt was tokenized
        content = "z" * (INLINE_TOKENIZE_CHARS + 1)
        await service.prepare_async({"messages": [{"role": "user", "content": content}]})
        assert threads[-1] is not threading.current_thread()
    finally:
        ticking.cancel()
    assert short.request.num_prompt_tokens == INLINE_TOKENIZE_CHARS
    assert long.request.prompt_token_ids == ids("y" * (INLINE_TOKENIZE_CHARS + 1))


async def test_an_sse_stream_failing_after_it_started_ends_with_an_error_event_and_done() -> None:
    from router.openai_api import Reply, merged, sse_events

    service, finished = make_service(FakePrefill(), FakeDecode("orld", error_at=0))
    body = {"prompt": "hello", "stream": True, "stream_options": {"include_usage": True}}
    prepared = service.prepare(body, "req-1")
    chunks = service.stream(prepared)
    first = await anext(chunks)
    reply = Reply([prepared], "cmpl-1", 0)
    events = [e.decode() async for e in sse_events(reply, first, merged([chunks]))]
    *data, error, done = events
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in data) == "Wor"
    body = json.loads(error.removeprefix("data: "))["error"]
    assert (body["code"], body["type"]) == (503, "service_unavailable")
    assert "after 3 tokens were delivered" in body["message"]
    assert done == "data: [DONE]\n\n"
    assert [outcome for outcome, _, _ in finished] == ["error"]


async def test_a_request_past_its_deadline_ends_deadline_exceeded_and_frees_its_slot() -> None:
    """A decode that stalls after two tokens: the router's bound ends the call, counts it as a
    timeout and releases its admission, while the chunks already sent stay sent."""
    from router.service import DeadlineExceeded

    finished: list[Finish] = []
    service = RouterService(
        FakeTokenizer(),
        RequestLimits(served_models=frozenset({MODEL}), default_model=MODEL),
        AdmissionLimits(max_in_flight=8, max_queued_prompt_tokens=1024),
        64,
        FakeEngines(FakePrefill(), FakeDecode("orld", gate=asyncio.Event(), gate_at=2)),
        on_finish=lambda outcome, timings, usage: finished.append(
            (outcome, timings, usage.completion_tokens)
        ),
        request_timeout_s=0.3,
    )
    chunks: list[StreamChunk] = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeadlineExceeded) as raised:
        async for chunk in service.stream(service.prepare({"prompt": "hello"}, "req-1")):
            chunks.append(chunk)
            await asyncio.sleep(0.05)  # the caller's own time is not cut short
    assert 0.3 <= loop.time() - started < 2.0
    assert "".join(c.text for c in chunks) == "Wor"
    assert raised.value.num_delivered == 3 and "router.request_timeout_s" in str(raised.value)
    assert [(outcome, n) for outcome, _, n in finished] == [("timeout", 3)]
    assert service.num_in_flight == 0
