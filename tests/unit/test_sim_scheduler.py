"""The sim engine's scheduler (engine/sim/scheduler.py): vLLM's policy as plain data."""

from __future__ import annotations

import pytest

from engine.sim.blocks import BlockPool
from engine.sim.scheduler import SimRequest, SimScheduler
from engine.sim.tokens import TokenSource

BLOCK = 4


def make_scheduler(
    num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 8, max_model_len: int = 1024
) -> SimScheduler:
    return SimScheduler(
        BlockPool(num_blocks, BLOCK),
        TokenSource(range(100, 200)),
        budget,
        max_num_seqs,
        max_model_len,
    )


def make_request(
    rid: str, num_prompt: int, max_tokens: int = 4, first: int = 0, kv_s: float | None = None
) -> SimRequest:
    prompt = tuple(range(first, first + num_prompt))
    return SimRequest(rid, prompt, max_tokens, TokenSource.request_seed(prompt, None), kv_s)


def run(scheduler: SimScheduler, now: float = 0.0, max_steps: int = 1000) -> list[list[tuple]]:
    """Every step's chunks as (request id, context, tokens) until nothing is left."""
    steps = []
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return steps
        step = scheduler.schedule(now)
        steps.append([(c.request.request_id, c.num_context, c.num_tokens) for c in step.chunks])
        scheduler.complete(step)
    raise AssertionError("scheduler did not finish")


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    scheduler = make_scheduler(budget=32)
    request = make_request("a", 100, max_tokens=3)
    scheduler.add(request)
    steps = run(scheduler)
    assert steps[:4] == [[("a", 0, 32)], [("a", 32, 32)], [("a", 64, 32)], [("a", 96, 4)]]
    assert steps[4:] == [[("a", 100, 1)], [("a", 101, 1)]]
    assert len(request.output_token_ids) == 3 and request.finish_reason == "length"
    assert scheduler.blocks.num_used_blocks == 0


def test_decodes_and_a_new_prefill_share_a_step_within_the_budget() -> None:
    scheduler = make_scheduler(budget=32)
    scheduler.add(make_request("a", 8, max_tokens=5))
    scheduler.complete(scheduler.schedule(0.0))  # a prefilled: first token
    scheduler.add(make_request("b", 40, max_tokens=2, first=500))
    step = scheduler.schedule(0.0)
    # a decodes one token; b takes the rest of the budget (31 of its 40 prompt tokens).
    assert [(c.request.request_id, c.num_tokens) for c in step.chunks] == [("a", 1), ("b", 31)]
    assert step.decode_contexts == [9] and step.prefill_chunks == [(0, 31)]


def test_when_blocks_run_out_the_newest_request_is_preempted_and_recomputed() -> None:
    # 6 blocks of 4 tokens: two 8-token prompts (2 blocks each) fit, their growth does not.
    scheduler = make_scheduler(num_blocks=6, budget=64)
    a, b = make_request("a", 8, max_tokens=8), make_request("b", 8, max_tokens=8, first=50)
    scheduler.add(a)
    scheduler.add(b)
    run(scheduler)
    assert scheduler.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert len(a.output_token_ids) == 8 and len(b.output_token_ids) == 8
    assert scheduler.blocks.num_used_blocks == 0


def test_max_num_seqs_bounds_the_running_batch() -> None:
    scheduler = make_scheduler(budget=256, max_num_seqs=2)
    for i in range(3):
        scheduler.add(make_request(str(i), 4, first=10 * i))
    step = scheduler.schedule(0.0)
    assert [c.request.request_id for c in step.chunks] == ["0", "1"]
    assert len(scheduler.waiting) == 1


def test_a_repeated_prompt_reuses_its_cached_full_blocks() -> None:
    scheduler = make_scheduler()
    first = make_request("a", 18, max_tokens=1)
    scheduler.add(first)
    run(scheduler)
    again = make_request("b", 18, max_tokens=1)
    scheduler.add(again)
    steps = run(scheduler)
    # 17 tokens are cacheable (the last is always computed): 4 full blocks = 16 tokens.
    assert again.num_cached_tokens == 16 and steps == [[("b", 16, 2)]]
    assert again.output_token_ids == first.output_token_ids


def test_a_consumer_holds_blocks_during_the_transfer_then_computes_one_position() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 20, max_tokens=2, kv_s=0.5)
    scheduler.add(request)
    assert scheduler.schedule(0.0).chunks == ()
    assert scheduler.blocks.num_used_blocks == 5 and scheduler.next_kv_ready_at() == 0.5
    assert scheduler.schedule(0.4).chunks == ()
    step = scheduler.schedule(0.5)
    assert [(c.num_context, c.num_tokens) for c in step.chunks] == [(19, 1)]
    assert request.num_cached_tokens == 19


def test_the_first_token_depends_on_the_prompt_only() -> None:
    producer, consumer = make_scheduler(), make_scheduler(budget=8)
    a, b = make_request("a", 30, max_tokens=1), make_request("b", 30, max_tokens=3, kv_s=0.0)
    producer.add(a)
    consumer.add(b)
    run(producer)
    run(consumer)
    assert a.output_token_ids[0] == b.output_token_ids[0]
    assert all(100 <= t < 200 for t in b.output_token_ids)


def test_abort_frees_the_request_blocks() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_request("a", 30, max_tokens=50))
    scheduler.complete(scheduler.schedule(0.0))
    assert scheduler.blocks.num_used_blocks > 0
    assert scheduler.abort("a") is not None and scheduler.abort("a") is None
    assert scheduler.blocks.num_used_blocks == 0 and scheduler.num_unfinished == 0


def test_a_request_larger_than_the_whole_cache_is_refused_not_left_waiting() -> None:
    scheduler = make_scheduler(num_blocks=4)  # 16 tokens
    with pytest.raises(ValueError, match="more KV than this engine has"):
        scheduler.add(make_request("a", 10, max_tokens=10))
    scheduler.add(make_request("b", 10, max_tokens=6))
    assert scheduler.num_unfinished == 1


def test_an_idle_engine_whose_first_request_waits_for_blocks_others_hold_is_not_stuck() -> None:
    """A decode engine: its stream preempts itself when a consumer's blocks (held for the KV in
    flight) leave it none; once that KV landed, nothing runs and the preempted request heads the
    queue without blocks. The consumer gives its blocks back (its KV pulled again later), so both
    finish; before, the engine waited forever (the planner saw requests that never ended)."""
    scheduler = make_scheduler(num_blocks=8, budget=64)
    stream = make_request("stream", 12, max_tokens=20)
    scheduler.add(stream)
    for _ in range(3):
        scheduler.complete(scheduler.schedule(0.0))
    consumer = make_request("consumer", 16, max_tokens=4, first=500, kv_s=0.5)
    scheduler.add(consumer)
    now, preempted_at = 0.0, None
    for _ in range(100):
        if not scheduler.num_unfinished:
            break
        step = scheduler.schedule(now)
        if step.num_preempted and preempted_at is None:
            preempted_at = now
        scheduler.complete(step)
        now = round(now + 0.1, 6)
    assert preempted_at is not None  # the stream did meet the consumer's held blocks
    assert stream.finish_reason == consumer.finish_reason == "length"
    assert len(stream.output_token_ids) == 20 and len(consumer.output_token_ids) == 4
    assert consumer.num_preemptions == 1 and scheduler.blocks.num_used_blocks == 0
