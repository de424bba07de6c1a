"""The engine pools as the router sees them: Serve handles behind the lifecycle's ports.

A streaming handle call that the router stops reading (client gone, stop string hit) is
cancelled explicitly, so the replica's engine aborts the request and frees its KV blocks.

With a token inbox (router/token_inbox.py), a stream's events do not come back as Serve items:
the call carries the inbox's route, the replica sends the events over its one connection to
this router (a frame per engine step for all its streams), and the call itself only starts,
holds and ends the request (Serve still routes it, counts it and cancels it; its error is the
replica's failure, as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from engine.intervals import merge
from engine.messages import GenerationRequest, KVHandoff, PrefillResult, TokenEvent
from router.lifecycle import (
    DEFAULT_MAX_MIGRATIONS,
    NO_REPLICAS,
    generate_colocated,
    generate_disaggregated,
)
from router.policy import PrefillPlacement
from router.token_inbox import InboxStream, TokenInbox


class RecentFailures:
    """Replicas that failed a request in this router process lately. The pools add them to
    every call's `avoid` for `ttl_s`, so a replica whose engine died gets no new request from
    this router while Serve's health checks (3 failures, 10 s apart) replace it, whatever
    Serve's routing stats say meanwhile (the controller refreshes them late under load)."""

    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._until: dict[str, float] = {}

    def mark(self, replica: str) -> None:
        self._until[replica] = self._clock() + self._ttl_s

    def recent(self) -> frozenset[str]:
        now = self._clock()
        self._until = {r: until for r, until in self._until.items() if until > now}
        return frozenset(self._until)


def _avoiding(avoid: frozenset[str]) -> dict[str, Any]:
    """The handle call's keyword for the pool's request router (router/replica_router.py):
    replicas that already failed this request. Absent on a first attempt."""
    return {"avoid": tuple(sorted(avoid))} if avoid else {}


def _unlinked(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)`, a handle's `.remote`, as a request of its own rather than a
    child of the router's request being served. Serve cancels an ingress request's children
    when that request is cancelled, from the replica's own loop while the handle's calls live
    on the handle's loop; under many cancels this router's handle stopped assigning calls to a
    replica for good. The lifecycle cancels its calls itself (`_stream_call`) and gives back a
    prefill nobody waits for (router/lifecycle.py)."""
    from ray.serve import context as serve_context

    current = serve_context._get_serve_request_context()
    own = serve_context._RequestContext(
        route=current.route, request_id=current.request_id, app_name=current.app_name
    )
    context = contextvars.copy_context()
    context.run(serve_context._serve_request_context.set, own)
    return context.run(call, *args, **kwargs)


async def _stream_call(response: Any) -> AsyncGenerator[Any]:
    finished = False
    try:
        async for item in response:
            yield item
        finished = True
    finally:
        if not finished:
            response.cancel()


# After a routed call ends, the events its replica sent before it returned (on the channel, a
# path of their own) reach the router within this, or the request moves.
TAIL_TIMEOUT_S = 10.0


class TokenChannelLost(ConnectionError):
    """A replica's call ended but its last events never arrived (a retryable failure)."""


_CALL_ENDED = object()


def _with_ready(stream: InboxStream, event: TokenEvent) -> TokenEvent:
    """`event` with the tokens that arrived behind it merged in (engine/intervals.py `merge`):
    a router that falls behind its replicas sends what piled up as one chunk, where the
    consumer pulls, with no timer; markers (`is_first`, `is_decode_start`) stay events of
    their own."""
    while event.finish_reason is None and not (event.is_first or event.is_decode_start):
        after = stream.peek()
        if not isinstance(after, TokenEvent) or after.is_first or after.is_decode_start:
            break
        event = merge(event, stream.pop())
    return event


async def _drain(response: Any) -> None:
    async for _ in response:  # a routed call yields nothing: its events go to the inbox
        pass


async def _routed_call(
    call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], inbox: TokenInbox
) -> AsyncGenerator[TokenEvent]:
    """The events of a streaming handle call whose replica sends them to `inbox`; the call's
    own end (or error) arrives in the same stream, after the events sent before it."""
    await inbox.start()
    route, stream = inbox.open()
    response = _unlinked(call, *args, route=route, **kwargs)
    ended = asyncio.ensure_future(_drain(response))
    ended.add_done_callback(lambda _: stream.push(_CALL_ENDED))
    finished = call_ended = False
    try:
        while True:
            if call_ended:
                try:
                    item = await asyncio.wait_for(stream.get(), TAIL_TIMEOUT_S)
                except TimeoutError:
                    raise TokenChannelLost(
                        f"the call ended, its last events did not arrive in {TAIL_TIMEOUT_S:g} s"
                    ) from None
            else:
                item = await stream.get()
            if item is _CALL_ENDED:
                call_ended = True
                if ended.cancelled():
                    raise asyncio.CancelledError()
                error = ended.exception()
                if error is not None:
                    raise error
                continue
            item = _with_ready(stream, item)
            yield item
            if item.finish_reason is not None:
                finished = True
                return
    finally:
        inbox.close(route)
        if not ended.done():
            if finished:  # the replica returns on its own, at once
                inbox.hold(ended)
            else:
                response.cancel()
                ended.cancel()


class _Pool:
    """A pool behind its Serve handle. Every call carries, as `avoid`, the replicas the request
    failed on and those that failed any request of this router lately (`failures`). With an
    `inbox`, streams come back over the token channel."""

    def __init__(
        self,
        handle: Any,
        failures: RecentFailures | None = None,
        handle_for: Callable[[], Any] | None = None,
        inbox: TokenInbox | None = None,
    ) -> None:
        self._fixed_handle = handle
        self._failures = failures or RecentFailures()
        # Per call: the handle of the pool holding the replicas that take this pool's calls
        # now (role flips, router/roles.py); None: always `handle`.
        self._handle_for = handle_for
        self._inbox = inbox

    @property
    def _handle(self) -> Any:
        return self._handle_for() if self._handle_for is not None else self._fixed_handle

    def _avoid(self, avoid: frozenset[str]) -> dict[str, Any]:
        return _avoiding(avoid | self._failures.recent())

    async def _stream(
        self, method: str, *args: Any, avoid: frozenset[str]
    ) -> AsyncGenerator[TokenEvent]:
        call = getattr(self._handle.options(stream=True), method)
        if self._inbox is not None:
            stream = _routed_call(call.remote, args, self._avoid(avoid), self._inbox)
        else:
            stream = _stream_call(_unlinked(call.remote, *args, **self._avoid(avoid)))
        async with contextlib.aclosing(stream) as events:  # closed with us: cancels the call
            async for event in events:
                yield event


class PrefillPool(_Pool):
    async def prefill(
        self, request: GenerationRequest, avoid: frozenset[str] = NO_REPLICAS
    ) -> PrefillResult:
        call = self._handle.prefill.remote
        result: PrefillResult = await _unlinked(call, request, **self._avoid(avoid))
        return result

    async def abort(self, request_id: str) -> None:
        # A handle call cannot be aimed at the replica that runs the prefill; the lifecycle lets
        # the (bounded) prefill finish and releases its handoff instead.
        return None


class DecodePool(_Pool):
    def __init__(
        self,
        handle: Any,
        release_is_idempotent: bool,
        failures: RecentFailures | None = None,
        handle_for: Callable[[], Any] | None = None,
        inbox: TokenInbox | None = None,
    ) -> None:
        super().__init__(handle, failures, handle_for, inbox)
        self._release_is_idempotent = release_is_idempotent

    @property
    def release_is_idempotent(self) -> bool:
        return self._release_is_idempotent

    def decode(
        self, request: GenerationRequest, handoff: KVHandoff, avoid: frozenset[str] = NO_REPLICAS
    ) -> AsyncIterator[TokenEvent]:
        return self._stream("decode", request, handoff, avoid=avoid)

    def generate(
        self, request: GenerationRequest, avoid: frozenset[str] = NO_REPLICAS
    ) -> AsyncIterator[TokenEvent]:
        return self._stream("generate", request, avoid=avoid)

    async def release(self, handoff: KVHandoff) -> None:
        await _unlinked(self._handle.release.remote, handoff)


class _Moves:
    """What both topologies do when a request fails on a replica: remember the replica (this
    process avoids it for a while) and count the move."""

    def __init__(self, on_move: Callable[[], None] | None) -> None:
        self.failures = RecentFailures()
        self._on_move = on_move

    def failed(self, replica: str | None, moved: bool) -> None:
        if replica is not None:
            self.failures.mark(replica)
        if moved and self._on_move is not None:
            self._on_move()


class DisaggregatedEngines:
    """Prefill pool -> first token -> decode pool (the `disaggregated` topology). A request
    that fails on a replica moves (router/lifecycle.py); `on_move` counts each move. With
    `pool_for`, each call goes through the handle of the pool it names for the call's role
    (router/roles.py): a flipped replica is reached through its own pool's handle. With
    `inbox`, the decode pool's streams come back over the token channel."""

    def __init__(
        self,
        prefill_handle: Any,
        decode_handle: Any,
        release_is_idempotent: bool,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        on_move: Callable[[], None] | None = None,
        local_prefill: PrefillPlacement | None = None,
        pool_for: Callable[[str], str] | None = None,
        inbox: TokenInbox | None = None,
    ) -> None:
        self._moves = _Moves(on_move)
        handles = {"prefill": prefill_handle, "decode": decode_handle}

        def handle_for(role: str) -> Callable[[], Any] | None:
            # `pool_for(role)`: the pool whose replicas take `role`'s calls now (role flips).
            return None if pool_for is None else lambda: handles[pool_for(role)]

        self._prefill = PrefillPool(prefill_handle, self._moves.failures, handle_for("prefill"))
        self._decode = DecodePool(
            decode_handle,
            release_is_idempotent,
            self._moves.failures,
            handle_for("decode"),
            inbox,
        )
        self._max_migrations = max_migrations
        self._local_prefill = local_prefill

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        return generate_disaggregated(
            self._prefill,
            self._decode,
            request,
            self._max_migrations,
            self._moves.failed,
            self._local_prefill.decide if self._local_prefill else None,
        )


class ColocatedPool(_Pool):
    """The colocated engine pool behind its Serve handle, as the lifecycle's port."""

    def generate(
        self, request: GenerationRequest, avoid: frozenset[str] = NO_REPLICAS
    ) -> AsyncIterator[TokenEvent]:
        return self._stream("generate", request, avoid=avoid)


class ColocatedEngines:
    """One engine pool serving both phases (the `colocated` topology); a request that fails on
    a replica moves to another, as in the disaggregated topology."""

    def __init__(
        self,
        handle: Any,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        on_move: Callable[[], None] | None = None,
        inbox: TokenInbox | None = None,
    ) -> None:
        self._moves = _Moves(on_move)
        self._pool = ColocatedPool(handle, self._moves.failures, inbox=inbox)
        self._max_migrations = max_migrations

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        return generate_colocated(self._pool, request, self._max_migrations, self._moves.failed)
