"""A router's end of the token channel (engine/token_wire.py): one listener per router replica,
the replicas' frames demultiplexed into one `InboxStream` per request.

A connection is served only after it sends the router's key (random per router replica, handed
to replicas inside the Serve calls that start requests); anything else is closed. A request's
stream holds at most the events of one answer (an engine makes no more than max_tokens), so a
slow client costs bounded memory and holds up no other stream: the router never stops reading.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
from collections import deque
from typing import Any

from engine.messages import TokenEvent
from engine.token_wire import (
    HEADER_BYTES,
    KEY_BYTES,
    TokenRoute,
    frame_length,
    unpack_items,
)

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0
# The address routers' token channels listen on, from their node's environment (default: the
# address Ray knows the node by, router/ingress.py).
TOKEN_CHANNEL_HOST_ENV = "PDSERVE_TOKEN_CHANNEL_HOST"


class InboxStream:
    """One request's events, in the order they arrived, and what ended the call beside them."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def push(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def peek(self) -> Any:
        """The next item if one is here, else None."""
        return self._items[0] if self._items else None

    def pop(self) -> Any:
        return self._items.popleft()

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class TokenInbox:
    def __init__(self, host: str, key: bytes | None = None) -> None:
        self.host = host
        self.key = key or secrets.token_bytes(KEY_BYTES)
        self.port = 0
        self.num_frames = 0  # received since start (a frame carries a replica's loop turn)
        self._streams: dict[int, InboxStream] = {}
        self._numbers = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._starting: asyncio.Future[None] | None = None
        self._held: set[asyncio.Future[Any]] = set()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        """Listen (once; later calls wait for the first)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._listen())
        await asyncio.shield(self._starting)

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), self.host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def open(self) -> tuple[TokenRoute, InboxStream]:
        """A new stream: the route a replica sends its events to, and where they arrive."""
        number = next(self._numbers)
        stream = InboxStream()
        self._streams[number] = stream
        return TokenRoute(self.host, self.port, self.key, number), stream

    def close(self, route: TokenRoute) -> None:
        """The stream is done: events that still arrive for it are dropped."""
        self._streams.pop(route.stream, None)

    def hold(self, ending: asyncio.Future[Any]) -> None:
        """Keep a finished stream's call until it returns (its result is not wanted)."""
        self._held.add(ending)
        ending.add_done_callback(_forget(self._held))

    def deliver(self, number: int, event: TokenEvent) -> None:
        stream = self._streams.get(number)
        if stream is not None:
            stream.push(event)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def _forget(held: set[asyncio.Future[Any]]) -> Any:
    def done(future: asyncio.Future[Any]) -> None:
        held.discard(future)
        if not future.cancelled() and future.exception() is not None:
            logger.debug("a finished stream's call ended with %r", future.exception())

    return done


class _Connection(asyncio.Protocol):
    def __init__(self, inbox: TokenInbox) -> None:
        self._inbox = inbox
        self._buffer = bytearray()
        self._is_open = False
        self._transport: asyncio.Transport | None = None
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(HELLO_TIMEOUT_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if not self._is_open:
            if len(buffer) < KEY_BYTES:
                return
            if not hmac.compare_digest(bytes(buffer[:KEY_BYTES]), self._inbox.key):
                logger.warning("token channel: a peer sent a wrong key; closed")
                self._close()
                return
            del buffer[:KEY_BYTES]
            self._is_open = True
            if self._hello_timer is not None:
                self._hello_timer.cancel()
        offset = 0
        deliver = self._inbox.deliver
        try:
            while len(buffer) - offset >= HEADER_BYTES:
                length = frame_length(bytes(buffer[offset : offset + HEADER_BYTES]))
                end = offset + HEADER_BYTES + length
                if len(buffer) < end:
                    break
                for number, event in unpack_items(bytes(buffer[offset + HEADER_BYTES : end])):
                    deliver(number, event)
                self._inbox.num_frames += 1
                offset = end
        except Exception as exc:  # a corrupt frame: nothing after it can be trusted
            logger.warning("token channel: %s; connection closed", exc)
            self._close()
            return
        if offset:
            del buffer[:offset]

    def _close(self) -> None:
        self._buffer.clear()
        if self._transport is not None:
            self._transport.close()
