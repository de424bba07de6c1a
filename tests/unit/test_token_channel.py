"""The token channel on real loopback sockets: a replica's TokenOutbox to a router's TokenInbox
(demultiplexed, in order, one frame per loop turn for all streams, closed to a wrong key), and
the router's side of a routed call (router/pools.py `_routed_call`): events, then the call's own
end or error, a lost tail, a cancel."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.messages import TokenEvent
from engine.token_outbox import TokenOutbox
from engine.token_wire import KEY_BYTES, TokenRoute, decode_item, encode_item
from router import pools
from router.pools import TokenChannelLost, _routed_call
from router.token_inbox import TokenInbox


async def _events(*events: TokenEvent) -> AsyncIterator[TokenEvent]:
    for event in events:
        yield event


async def _take(stream: Any, n: int, timeout_s: float = 5.0) -> list[Any]:
    return [await asyncio.wait_for(stream.get(), timeout_s) for _ in range(n)]


def test_an_event_survives_the_wire_whole() -> None:
    event = TokenEvent(
        (5, 6),
        "stop",
        is_first=True,
        prefill_seconds=0.25,
        replica_id="decode-x",
        logprobs=(((5, -0.1), (7, -2.0)), ((6, -0.3),)),
    )
    assert decode_item(encode_item(9, event)) == (9, event)


async def test_streams_of_one_replica_share_a_frame_per_loop_turn() -> None:
    inbox = TokenInbox("127.0.0.1")
    await inbox.start()
    routes = [inbox.open() for _ in range(3)]
    outbox = TokenOutbox()
    link = await outbox.link(routes[0][0])
    for step in range(4):  # an engine step: every stream's token, then the loop turns
        for route, _ in routes:
            link.send(route.stream, TokenEvent((100 * route.stream + step,), None))
        await asyncio.sleep(0)
    for route, stream in routes:
        got = await _take(stream, 4)
        assert [e.token_ids[0] for e in got] == [100 * route.stream + s for s in range(4)]
    assert inbox.num_frames == 4  # one per step, not one per token
    assert outbox.num_links == 1
    outbox.close()
    await inbox.stop()


async def test_a_wrong_key_is_refused_and_nothing_is_delivered() -> None:
    inbox = TokenInbox("127.0.0.1")
    await inbox.start()
    route, stream = inbox.open()
    wrong = TokenRoute(route.host, route.port, bytes(KEY_BYTES), route.stream)
    outbox = TokenOutbox()
    link = await outbox.link(wrong)
    link.send(wrong.stream, TokenEvent((1,), "stop"))
    await asyncio.sleep(0.2)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(stream.get(), 0.2)
    assert inbox.num_frames == 0
    outbox.close()
    await inbox.stop()


class _Response:
    """A streaming handle call's response: ends (or raises) when `finished` is set."""

    def __init__(self, work: asyncio.Task[None], error: BaseException | None = None) -> None:
        self.work = work
        self.error = error
        self.cancelled = False

    def __aiter__(self) -> _Response:
        return self

    async def __anext__(self) -> Any:
        await self.work
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True
        self.work.cancel()


def _replica(
    *events: TokenEvent, error: BaseException | None = None, delay_s: float = 0.0
) -> tuple[Any, list[_Response]]:
    """A `call.remote` whose replica sends `events` over the channel, then ends."""
    outbox = TokenOutbox()
    made: list[_Response] = []

    def remote(*args: Any, route: TokenRoute, **kwargs: Any) -> _Response:
        async def work() -> None:
            await asyncio.sleep(delay_s)
            await outbox.send_all(_events(*events), route)

        response = _Response(asyncio.ensure_future(work()), error)
        made.append(response)
        return response

    return remote, made


async def _collect(stream: AsyncIterator[TokenEvent]) -> list[TokenEvent]:
    return [event async for event in stream]


async def test_a_routed_call_yields_its_events_until_the_finish() -> None:
    """Events that arrived together leave as one (a consumer that fell behind pulls what piled
    up), the replica named and the finish kept; a marker stays an event of its own."""
    inbox = TokenInbox("127.0.0.1")
    events = [
        TokenEvent((7,), None, is_first=True, replica_id="decode-a"),
        TokenEvent((1,), None, replica_id="decode-a"),
        TokenEvent((2,), None),
        TokenEvent((3,), "length"),
    ]
    remote, _ = _replica(*events)
    got = await _collect(_routed_call(remote, (), {}, inbox))
    assert got == [events[0], TokenEvent((1, 2, 3), "length", replica_id="decode-a")]
    assert inbox.num_streams == 0
    await inbox.stop()


async def test_a_failed_call_raises_its_error_after_what_arrived_before_it() -> None:
    """The error and the events take different paths: what was delivered before the error is
    a prefix of what the replica sent (the lifecycle resumes from what was delivered)."""
    inbox = TokenInbox("127.0.0.1")
    sent = [TokenEvent((1,), None), TokenEvent((2,), None)]
    remote, _ = _replica(*sent, error=RuntimeError("replica died"))
    got: list[TokenEvent] = []
    with pytest.raises(RuntimeError, match="replica died"):
        async for event in _routed_call(remote, (), {}, inbox):
            got.append(event)
    assert got == sent[: len(got)]
    assert inbox.num_streams == 0
    await inbox.stop()


async def test_a_call_that_ends_without_its_finish_arriving_is_a_lost_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pools, "TAIL_TIMEOUT_S", 0.2)
    inbox = TokenInbox("127.0.0.1")
    remote, _ = _replica(TokenEvent((1,), None))  # no finish: the call just ends
    with pytest.raises(TokenChannelLost):
        await _collect(_routed_call(remote, (), {}, inbox))
    await inbox.stop()


async def test_closing_the_stream_early_cancels_the_call() -> None:
    inbox = TokenInbox("127.0.0.1")
    remote, made = _replica(TokenEvent((1,), None), TokenEvent((2,), "length"), delay_s=30)
    stream = _routed_call(remote, (), {}, inbox)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.2)
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    await stream.aclose()  # type: ignore[attr-defined]
    assert made[0].cancelled
    assert inbox.num_streams == 0
    await inbox.stop()


async def test_an_unreachable_router_is_an_error_naming_its_address() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed below: nothing listens there
    route = TokenRoute("127.0.0.1", port, bytes(KEY_BYTES), 1)
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        await TokenOutbox().send_all(_events(TokenEvent((1,), "stop")), route)


def test_local_mode_puts_the_routers_channels_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.cli import LOCAL_CONFIG
    from deploy.config import load_app_config
    from deploy.up import _cluster_env
    from router.ingress import _channel_host
    from router.token_inbox import TOKEN_CHANNEL_HOST_ENV

    env = _cluster_env(load_app_config(LOCAL_CONFIG), None)
    assert env[TOKEN_CHANNEL_HOST_ENV] == "127.0.0.1"
    monkeypatch.setenv(TOKEN_CHANNEL_HOST_ENV, "127.0.0.1")
    assert _channel_host() == "127.0.0.1"
    monkeypatch.delenv(TOKEN_CHANNEL_HOST_ENV)
    assert _channel_host()  # Ray's node address where Ray runs, else loopback
