"""The request lifecycle across the pools: prefill -> first token -> decode stream.

Ownership: every handoff that prefill returns ends here in a decode (which consumes the lease)
or a release (finished at the first token, cancelled, or refused).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from decode_workers.worker import DecodeWorker
from engine.request import GenerationRequest
from prefill_workers.worker import PrefillWorker


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
    result = await prefill.prefill(request)
    decoding = False
    try:
        yield TokenEvent((result.first_token,), result.finish_reason, from_prefill=True)
        if result.finish_reason is not None:
            return
        decoding = True
        async for chunk in decode.decode(request, result.handoff):
            yield TokenEvent(chunk.token_ids, chunk.finish_reason)
    finally:
        if not decoding:
            await decode.release(result.handoff)
