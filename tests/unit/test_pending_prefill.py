"""Prompt tokens a replica has accepted and not prefilled (prefill_workers/replica.py
`PendingPrefill`): what colocated and decode replicas report as their prefill queue."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from engine.messages import TokenEvent
from prefill_workers.replica import PendingPrefill


async def stream(first: asyncio.Event, fail: bool = False) -> AsyncIterator[TokenEvent]:
    await first.wait()
    if fail:
        raise RuntimeError("engine died")
    yield TokenEvent((1,), None, is_first=True)
    yield TokenEvent((2,), "length")


async def test_tokens_count_until_the_first_event_or_the_end() -> None:
    pending = PendingPrefill()
    go_a, go_b, go_c = asyncio.Event(), asyncio.Event(), asyncio.Event()
    a = pending.counted(100, stream(go_a))
    b = pending.counted(30, stream(go_b, fail=True))
    c = pending.counted(7, stream(go_c))
    first_a = asyncio.ensure_future(anext(a))
    failed_b = asyncio.ensure_future(anext(b))
    first_c = asyncio.ensure_future(anext(c))
    await asyncio.sleep(0)
    assert pending.num_tokens == 137
    go_a.set()
    assert (await first_a).is_first
    assert pending.num_tokens == 37  # a's prompt is computed
    go_b.set()
    with pytest.raises(RuntimeError):
        await failed_b
    assert pending.num_tokens == 7  # b failed before its first token
    first_c.cancel()  # the caller walked away before c's first token
    with contextlib.suppress(asyncio.CancelledError):
        await first_c
    await c.aclose()
    assert pending.num_tokens == 0
    assert [e.token_ids async for e in a] == [(2,)]
    assert pending.num_tokens == 0
