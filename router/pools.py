"""The engine pools as the router sees them: Serve handles behind the lifecycle's ports.

A streaming handle call that the router stops reading (client gone, stop string hit) is
cancelled explicitly, so the replica's engine aborts the request and frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from engine.messages import GenerationRequest, KVHandoff, PrefillResult, TokenEvent
from router.lifecycle import DEFAULT_MAX_MIGRATIONS, NO_REPLICAS, generate_disaggregated


def _avoiding(avoid: frozenset[str]) -> dict[str, Any]:
    """The handle call's keyword for the pool's request router (router/replica_router.py):
    replicas that already failed this request. Absent on a first attempt."""
    return {"avoid": tuple(sorted(avoid))} if avoid else {}


async def _stream_call(response: Any) -> AsyncIterator[Any]:
    finished = False
    try:
        async for item in response:
            yield item
        finished = True
    finally:
        if not finished:
            response.cancel()


class PrefillPool:
    def __init__(self, handle: Any) -> None:
        self._handle = handle

    async def prefill(
        self, request: GenerationRequest, avoid: frozenset[str] = NO_REPLICAS
    ) -> PrefillResult:
        result: PrefillResult = await self._handle.prefill.remote(request, **_avoiding(avoid))
        return result

    async def abort(self, request_id: str) -> None:
        # A handle call cannot be aimed at the replica that runs the prefill; the lifecycle lets
        # the (bounded) prefill finish and releases its handoff instead.
        return None


class DecodePool:
    def __init__(self, handle: Any, release_is_idempotent: bool) -> None:
        self._handle = handle
        self._release_is_idempotent = release_is_idempotent

    @property
    def release_is_idempotent(self) -> bool:
        return self._release_is_idempotent

    async def decode(
        self, request: GenerationRequest, handoff: KVHandoff, avoid: frozenset[str] = NO_REPLICAS
    ) -> AsyncIterator[TokenEvent]:
        call = self._handle.options(stream=True).decode
        async for chunk in _stream_call(call.remote(request, handoff, **_avoiding(avoid))):
            yield chunk

    async def release(self, handoff: KVHandoff) -> None:
        await self._handle.release.remote(handoff)


class DisaggregatedEngines:
    """Prefill pool -> first token -> decode pool (the `disaggregated` topology)."""

    def __init__(
        self,
        prefill_handle: Any,
        decode_handle: Any,
        release_is_idempotent: bool,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
    ) -> None:
        self._prefill = PrefillPool(prefill_handle)
        self._decode = DecodePool(decode_handle, release_is_idempotent)
        self._max_migrations = max_migrations

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        async for event in generate_disaggregated(
            self._prefill, self._decode, request, self._max_migrations
        ):
            yield event


class ColocatedEngines:
    """One engine pool serving both phases (the `colocated` topology)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        async for event in _stream_call(self._handle.options(stream=True).generate.remote(request)):
            yield event
