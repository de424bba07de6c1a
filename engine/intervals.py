"""Several tokens per streamed message: an engine replica's events merged `interval` tokens at
a time, as vLLM's `--stream-interval` does for its own outputs.

Every token of a stream is otherwise a message of its own through two Serve streaming hops
(engine replica -> router -> proxy), and a message costs about the same whatever it carries
(docs/benchmarks.md, the streaming ceiling). With an interval of N, the first event of a
stream (the first token, or a decode replica's first; it names the replica) and every marker
(`is_first`, `is_decode_start`) go at once; later tokens wait until N of them are ready, or the
stream finishes. A client sees the same tokens, in fewer, larger messages: the mean time per
token stays, tokens arrive in steps of N.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from engine.messages import TokenEvent


def merge(a: TokenEvent, b: TokenEvent) -> TokenEvent:
    """`b`'s tokens after `a`'s, in one event: `b`'s finish, the first replica named."""
    logprobs = None if a.logprobs is None or b.logprobs is None else a.logprobs + b.logprobs
    return replace(
        a,
        token_ids=a.token_ids + b.token_ids,
        finish_reason=b.finish_reason,
        replica_id=a.replica_id or b.replica_id,
        logprobs=logprobs,
    )


def in_intervals(events: AsyncIterator[TokenEvent], interval: int) -> AsyncIterator[TokenEvent]:
    """`events`, their tokens merged `interval` at a time after the stream's first; at 1,
    `events` themselves (no generator added on every token's path)."""
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    return events if interval == 1 else _merged(events, interval)


async def _merged(events: AsyncIterator[TokenEvent], interval: int) -> AsyncIterator[TokenEvent]:
    held: TokenEvent | None = None
    started = False
    async for event in events:
        if not started or event.is_first or event.is_decode_start:
            if held is not None:
                yield held
                held = None
            started = started or bool(event.token_ids) or event.finish_reason is not None
            yield event
            continue
        held = event if held is None else merge(held, event)
        if len(held.token_ids) >= interval or held.finish_reason is not None:
            yield held
            held = None
    if held is not None:
        yield held
