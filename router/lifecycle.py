"""The request lifecycle across the pools: prefill -> first token -> decode stream.

Ownership: every handoff that prefill returns ends here in a decode (which consumes the lease)
or a release (finished at the first token, cancelled, or refused).

The pools are ports: a PrefillWorker/DecodeWorker in-process (engine tests), or Serve handles to
the pools (the app). Both satisfy `PrefillPort` / `DecodePort`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from engine.messages import GenerationRequest, KVHandoff, PrefillResult, TokenEvent


class PrefillPort(Protocol):
    async def prefill(self, request: GenerationRequest) -> PrefillResult: ...

    async def abort(self, request_id: str) -> None: ...


class DecodePort(Protocol):
    @property
    def release_is_idempotent(self) -> bool: ...

    def decode(
        self, request: GenerationRequest, handoff: KVHandoff
    ) -> AsyncIterator[TokenEvent]: ...

    async def release(self, handoff: KVHandoff) -> None: ...


async def generate_disaggregated(
    prefill: PrefillPort, decode: DecodePort, request: GenerationRequest
) -> AsyncIterator[TokenEvent]:
    request = request.with_pinned_seed()
    result = await _prefill_or_give_back(prefill, decode, request)
    decoding = False
    try:
        yield TokenEvent(
            (result.first_token,),
            result.finish_reason,
            is_first=True,
            prefill_seconds=result.prefill_seconds,
            replica_id=result.handoff.producer_id,
        )
        if result.finish_reason is not None:
            return
        yield TokenEvent((), None, is_decode_start=True)
        decoding = True
        finished = False
        try:
            async for event in decode.decode(request, result.handoff):
                finished = event.finish_reason is not None
                yield event
        finally:
            if not finished and decode.release_is_idempotent:
                await decode.release(result.handoff)
    finally:
        if not decoding:
            await decode.release(result.handoff)


async def _prefill_or_give_back(
    prefill: PrefillPort, decode: DecodePort, request: GenerationRequest
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
