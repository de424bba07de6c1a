"""The request lifecycle across the pools: prefill -> first token -> decode stream.

Ownership: every handoff that prefill returns ends here in a decode (which consumes the lease)
or a release (finished at the first token, cancelled, or refused).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from decode_workers.worker import DecodeWorker
from engine.request import GenerationRequest
from prefill_workers.worker import PrefillResult, PrefillWorker


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    finish_reason: str | None
    # True for the first token, streamed as soon as prefill returns (TTFT ends here).
    from_prefill: bool = False


async def generate_disaggregated(
    prefill: PrefillWorker, decode: DecodeWorker, request: GenerationRequest
) -> AsyncIterator[TokenEvent]:
    request = request.with_pinned_seed()
    result = await _prefill_or_give_back(prefill, decode, request)
    decoding = False
    try:
        yield TokenEvent((result.first_token,), result.finish_reason, from_prefill=True)
        if result.finish_reason is not None:
            return
        decoding = True
        finished = False
        try:
            async for chunk in decode.decode(request, result.handoff):
                finished = chunk.finish_reason is not None
                yield TokenEvent(chunk.token_ids, chunk.finish_reason)
        finally:
            if not finished and decode.backend.release_is_idempotent:
                await decode.release(result.handoff)
    finally:
        if not decoding:
            await decode.release(result.handoff)


async def _prefill_or_give_back(
    prefill: PrefillWorker, decode: DecodeWorker, request: GenerationRequest
) -> PrefillResult:
    """Prefill, safe against the caller being cancelled meanwhile: the engine may finish the
    request (and its connector store the KV under a lease) just as the cancel arrives, and then
    nobody else holds the handoff that frees it."""
    task = asyncio.ensure_future(prefill.prefill(request))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await prefill.abort(request.request_id)
        try:
            result = await task
        except Exception:  # aborted before the KV was stored: nothing to give back
            raise asyncio.CancelledError() from None
        await decode.release(result.handoff)
        raise
