"""An engine replica's end of the token channel (engine/token_wire.py): one connection per
router, a frame per loop turn carrying every event its streams made meanwhile.

    stream A --send--+
    stream B --send--+--> pending items --call_soon(flush)--> one frame --> router
    stream C --send--+

An engine step wakes every stream it advanced before the loop runs anything scheduled after:
the flush that the step's first `send` scheduled runs once all of them have sent, so the step
leaves as one frame. With one stream, its token leaves on the next loop turn (no timer).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from engine.messages import TokenEvent
from engine.token_wire import TokenRoute, encode_item, frame

CONNECT_TIMEOUT_S = 5.0
# Past this much unsent to a router, a stream waits for the socket before it sends more: a
# router that stops reading holds back its own streams, and the replica's memory is bounded.
HIGH_WATER_BYTES = 4 * 1024**2


class _Link:
    """The connection to one router."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._pending: list[list[Any]] = []
        self._scheduled = False

    @property
    def is_closed(self) -> bool:
        return self._writer.is_closing()

    def send(self, stream: int, event: TokenEvent) -> None:
        if self._writer.is_closing():
            raise ConnectionError("the router's token channel is closed")
        self._pending.append(encode_item(stream, event))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._pending and not self._writer.is_closing():
            self._writer.write(frame(self._pending))
        self._pending = []

    @property
    def is_congested(self) -> bool:
        """The socket holds more than HIGH_WATER_BYTES unsent."""
        return self._writer.transport.get_write_buffer_size() > HIGH_WATER_BYTES

    async def drain(self) -> None:
        await self._writer.drain()

    def close(self) -> None:
        self._writer.close()


class TokenOutbox:
    """The links of one replica to the routers it streams to, opened on first use."""

    def __init__(self) -> None:
        self._links: dict[tuple[str, int], _Link] = {}
        self._opening: dict[tuple[str, int], asyncio.Future[_Link]] = {}

    @property
    def num_links(self) -> int:
        return sum(1 for link in self._links.values() if not link.is_closed)

    async def link(self, route: TokenRoute) -> _Link:
        address = route.address
        link = self._links.get(address)
        if link is not None and not link.is_closed:
            return link
        opening = self._opening.get(address)
        if opening is None:
            opening = asyncio.ensure_future(self._open(route))
            self._opening[address] = opening
            opening.add_done_callback(lambda _: self._opening.pop(address, None))
        return await asyncio.shield(opening)

    async def _open(self, route: TokenRoute) -> _Link:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(route.host, route.port), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError) as exc:
            raise ConnectionError(
                f"cannot reach the router's token channel at {route.host}:{route.port} "
                f"({type(exc).__name__}: {exc}); replicas must reach their routers' nodes"
            ) from exc
        writer.write(route.key)
        link = _Link(writer)
        self._links[route.address] = link
        return link

    async def send_all(self, events: AsyncIterator[TokenEvent], route: TokenRoute) -> None:
        """Every event of `events` to `route`'s stream."""
        link = await self.link(route)
        async for event in events:
            link.send(route.stream, event)
            if link.is_congested:  # checked per event; awaited only when the router lags
                await link.drain()

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
