"""The request lifecycle across the pools: prefill -> first token -> decode stream, and the
stream's migration when an engine fails under it.

Ownership: every handoff that prefill returns ends here in a decode (which consumes the lease)
or a release (finished at the first token, cancelled, or refused).

Migration: when prefill or decode fails (a replica or its engine died, a load failed, under
`failure_policy: fail` too, or a lease expired), the request starts again on other replicas
with the prompt plus every token already delivered, and max_tokens less those; the caller's
stream goes on from the next token, with no token repeated or missing (greedy output is the
uninterrupted run's). The replicas that failed the request are passed on (`avoid`) so the
request routers choose others. After `max_migrations` such restarts the next failure is a
`StreamInterrupted` naming how many tokens were delivered; so is the first failure after a token
of a request under a structured-output constraint, which cannot resume from a longer prompt. A
request that failed on `PREFILL_TRIES` prefill replicas (or on one, when its next attempt is its
last) is prefilled by a decode replica itself, with no transfer. Errors in the request itself
(ValueError: too long a prompt, a KV layout mismatch) are not retried.

The pools are ports: a PrefillWorker/DecodeWorker in-process (engine tests), or Serve handles to
the pools (the app). Both satisfy `PrefillPort` / `DecodePort`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace
from typing import Protocol

from engine.messages import (
    GenerationRequest,
    KVHandoff,
    KVTransferError,
    PrefillResult,
    TokenEvent,
)

logger = logging.getLogger(__name__)

# Giving back what a cancelled request holds: a release call waits this long at most, and a
# prefill that was running when the cancel came this long to finish. Past either, the KV
# expires with its lease (transfer.lease_seconds); the request's admission slot waits on both.
RELEASE_TIMEOUT_S = 10.0
GIVE_BACK_PREFILL_TIMEOUT_S = 60.0

# Restarts of one request after an engine failure before its stream fails.
DEFAULT_MAX_MIGRATIONS = 2
# Prefill replicas a request is sent to before a decode replica prefills it itself (sooner when
# the next attempt is its last).
PREFILL_TRIES = 2

NO_REPLICAS: frozenset[str] = frozenset()

FailureHook = Callable[[str | None, bool], None]


class PrefillPort(Protocol):
    async def prefill(
        self, request: GenerationRequest, avoid: frozenset[str] = NO_REPLICAS
    ) -> PrefillResult: ...

    async def abort(self, request_id: str) -> None: ...


class DecodePort(Protocol):
    @property
    def release_is_idempotent(self) -> bool: ...

    def decode(
        self, request: GenerationRequest, handoff: KVHandoff, avoid: frozenset[str] = NO_REPLICAS
    ) -> AsyncIterator[TokenEvent]: ...

    def generate(
        self, request: GenerationRequest, avoid: frozenset[str] = NO_REPLICAS
    ) -> AsyncIterator[TokenEvent]:
        """The whole request on a decode replica, prefill included (no prefill replica)."""
        ...

    async def release(self, handoff: KVHandoff) -> None: ...


class ColocatedPort(Protocol):
    def generate(
        self, request: GenerationRequest, avoid: frozenset[str] = NO_REPLICAS
    ) -> AsyncIterator[TokenEvent]: ...


class StreamInterrupted(RuntimeError):
    """The engines failed under a request more often than it may move (gRPC UNAVAILABLE, HTTP
    503, or an error event on a stream already started)."""

    def __init__(self, request_id: str, num_delivered: int, num_attempts: int) -> None:
        super().__init__(
            f"request {request_id} failed after {num_delivered} tokens were delivered "
            f"({num_attempts} attempts); retry it"
        )
        self.num_delivered = num_delivered
        self.num_attempts = num_attempts


def is_retryable(exc: BaseException) -> bool:
    """An engine, replica or transfer failure, which other replicas may not have. ValueError
    (Ray's task errors are instances of their cause) is the request's own fault."""
    return isinstance(exc, Exception) and not isinstance(exc, ValueError)


def continuation(
    request: GenerationRequest, delivered: list[int], attempt: int
) -> GenerationRequest:
    """The request that goes on after `delivered`: the prompt plus those tokens, max_tokens less
    them (min_tokens too), under a new id (the failed attempt may still be known to an engine).
    Presence and frequency penalties count the delivered tokens as prompt from here on: a moved
    request that uses them may differ from an unmoved one."""
    params = replace(
        request.params,
        max_tokens=request.params.max_tokens - len(delivered),
        min_tokens=max(0, request.params.min_tokens - len(delivered)),
    )
    return replace(
        request,
        request_id=f"{request.request_id}~{attempt}",
        prompt_token_ids=request.prompt_token_ids + tuple(delivered),
        params=params,
    )


def generate_disaggregated(
    prefill: PrefillPort,
    decode: DecodePort,
    request: GenerationRequest,
    max_migrations: int = DEFAULT_MAX_MIGRATIONS,
    on_failure: FailureHook | None = None,
    prefill_locally: Callable[[GenerationRequest], bool] | None = None,
) -> AsyncGenerator[TokenEvent]:
    """Prefill, then decode, moved to other replicas when one fails (see the module's doc).
    The stream itself, not a wrapper: closing it closes the attempt under it at once.
    `prefill_locally(request)`: the router's choice for a new request; True sends it whole to a
    decode replica, which prefills it itself (conditional disaggregation)."""

    failed: list[_Holder] = []  # the attempts so far: each new one means the last failed

    def attempt(request: GenerationRequest, avoid: frozenset[str], at: _Holder) -> Attempt:
        num_prefill_failures = sum(1 for h in failed if h.phase == "prefill")
        is_last = len(failed) == max_migrations
        is_new = not failed
        failed.append(at)
        # A decode replica prefills for itself when the router chose so for a new request, or
        # when no prefill replica could take it.
        chosen = is_new and prefill_locally is not None and prefill_locally(request)
        if chosen or num_prefill_failures >= PREFILL_TRIES or (num_prefill_failures and is_last):
            return _on_decode_alone(decode, request, avoid, at)
        return _one_attempt(prefill, decode, request, avoid, at)

    return migrating(attempt, request, max_migrations, on_failure)


def generate_colocated(
    engines: ColocatedPort,
    request: GenerationRequest,
    max_migrations: int = DEFAULT_MAX_MIGRATIONS,
    on_failure: FailureHook | None = None,
) -> AsyncGenerator[TokenEvent]:
    """One engine for both phases, moved to another engine replica when it fails."""

    async def attempt(
        request: GenerationRequest, avoid: frozenset[str], at: _Holder
    ) -> AsyncGenerator[TokenEvent]:
        async with contextlib.aclosing(engines.generate(request, avoid)) as events:  # type: ignore[type-var]
            async for event in events:
                if event.replica_id:
                    at.replica = event.replica_id
                yield event

    return migrating(attempt, request, max_migrations, on_failure)


Attempt = AsyncGenerator[TokenEvent]


async def migrating(
    attempt: Callable[[GenerationRequest, frozenset[str], _Holder], Attempt],
    request: GenerationRequest,
    max_migrations: int = DEFAULT_MAX_MIGRATIONS,
    on_failure: FailureHook | None = None,
) -> AsyncGenerator[TokenEvent]:
    """The events of `attempt(request, avoid, at)`, and when an attempt fails, of a new one
    for the rest of the answer (`continuation`), avoiding the replicas that failed it; `at`
    follows the replica that holds the request. `on_failure(replica, moved)`: an attempt failed
    on `replica` (None: not known); `moved` says whether the request goes on elsewhere."""
    request = request.with_pinned_seed()
    delivered: list[int] = []
    failed_on: set[str] = set()
    number = 0
    while True:
        current = continuation(request, delivered, number) if number else request
        resumed = bool(delivered)  # the caller's stream already had its first token
        at = _Holder()
        try:
            # Closed with this stream (client gone): its finally gives back what it holds.
            async with contextlib.aclosing(attempt(current, frozenset(failed_on), at)) as events:
                async for event in events:
                    if resumed and (event.is_first or event.is_decode_start):
                        if event.is_decode_start:
                            continue
                        event = replace(event, is_first=False, prefill_seconds=0.0, replica_id="")
                    delivered.extend(event.token_ids)
                    yield event
            return
        except Exception as exc:
            if not is_retryable(exc):
                raise
            # The replica that failed: the one last heard from, or the one the error names
            # (a replica that failed before its first answer: ReplicaFailure).
            at.replica = at.replica or getattr(exc, "replica_id", None)
            # A constraint starts at the answer's first token: an answer cut after some tokens
            # cannot go on under it from a longer prompt, so such a request is not moved.
            moved = number < max_migrations and not (delivered and request.params.structured)
            if on_failure is not None:
                on_failure(at.replica, moved)
            if not moved:
                raise StreamInterrupted(request.request_id, len(delivered), number + 1) from exc
            if at.replica is not None:
                failed_on.add(at.replica)
            number += 1
            logger.warning(
                "request %s failed on %s after %d tokens (%s: %s); moving it (attempt %d of %d)",
                request.request_id,
                at.replica or "an unknown replica",
                len(delivered),
                type(exc).__name__,
                exc,
                number + 1,
                max_migrations + 1,
            )


class _Holder:
    """The replica holding an attempt's request now (None: not known, e.g. decode was called
    and has not answered yet), and the phase it is in."""

    replica: str | None = None
    phase: str = "prefill"


async def _on_decode_alone(
    decode: DecodePort, request: GenerationRequest, avoid: frozenset[str], at: _Holder
) -> AsyncGenerator[TokenEvent]:
    """The whole request on a decode replica, which prefills it itself (no KV transfer). The
    replica names itself on the first token; its first event after that names it again, as
    the decode phase's (the request's timings then say both phases ran there: "local")."""
    at.phase = "decode"
    named_decode = False
    async with contextlib.aclosing(decode.generate(request, avoid)) as events:  # type: ignore[type-var]
        async for event in events:
            if event.replica_id:
                at.replica = event.replica_id
            elif not named_decode and not event.is_first and at.replica is not None:
                event = replace(event, replica_id=at.replica)
            named_decode = named_decode or not event.is_first
            yield event


async def _one_attempt(
    prefill: PrefillPort,
    decode: DecodePort,
    request: GenerationRequest,
    avoid: frozenset[str],
    at: _Holder,
) -> AsyncGenerator[TokenEvent]:
    """Prefill then decode once; `at` follows the replica that holds the request."""
    result = await _prefill_or_give_back(prefill, decode, request, avoid)
    at.replica = result.handoff.producer_id
    at.phase = "decode"
    decoding = False
    try:
        yield TokenEvent(
            (result.first_token,),
            result.finish_reason,
            is_first=True,
            prefill_seconds=result.prefill_seconds,
            replica_id=result.handoff.producer_id,
            logprobs=(result.first_logprobs,) if result.first_logprobs is not None else None,
        )
        if result.finish_reason is not None:
            return
        yield TokenEvent((), None, is_decode_start=True)
        decoding = True
        at.replica = None
        finished = False
        try:
            # Closed with this attempt (client gone): cancels the decode call now, not at GC.
            stream = decode.decode(request, result.handoff, avoid)
            async with contextlib.aclosing(stream) as events:  # type: ignore[type-var]
                async for event in events:
                    if event.replica_id:
                        at.replica = event.replica_id
                    if event.finish_reason == "error":
                        # vLLM's kv_load_failure_policy "fail": the KV never arrived.
                        raise KVTransferError(
                            f"decode could not load the KV of {request.request_id}"
                        )
                    finished = event.finish_reason is not None
                    yield event
        finally:
            if not finished and decode.release_is_idempotent:
                await _release(decode, result.handoff)
    finally:
        if not decoding:
            await _release(decode, result.handoff)


async def _release(decode: DecodePort, handoff: KVHandoff) -> None:
    """Give a handoff back, waiting RELEASE_TIMEOUT_S at most; a failure here (the pool itself
    failing, or slow) leaves the lease to expire, and must not hide the error that brought us
    here."""
    try:
        await asyncio.wait_for(decode.release(handoff), RELEASE_TIMEOUT_S)
    except Exception as exc:
        logger.warning(
            "releasing the KV of %s failed (%s: %s); it expires with its lease",
            handoff.request_id,
            type(exc).__name__,
            exc,
        )


async def _prefill_or_give_back(
    prefill: PrefillPort, decode: DecodePort, request: GenerationRequest, avoid: frozenset[str]
) -> PrefillResult:
    """Prefill, safe against the caller being cancelled meanwhile: the engine may finish the
    request (and its connector store the KV under a lease) just as the cancel arrives, and then
    nobody else holds the handoff that frees it."""
    task = asyncio.ensure_future(prefill.prefill(request, avoid))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await prefill.abort(request.request_id)
        try:
            # Bounded: past it the prefill is cancelled, and what it stored expires with its
            # lease.
            result = await asyncio.wait_for(task, GIVE_BACK_PREFILL_TIMEOUT_S)
        except Exception:  # aborted before the KV was stored (or past the bound): none to free
            raise asyncio.CancelledError() from None
        await _release(decode, result.handoff)
        raise
