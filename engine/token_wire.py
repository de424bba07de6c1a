"""The token channel's wire: what an engine replica sends a router, a frame per engine step.

    replica (TokenOutbox) ==== one TCP connection per replica-router pair ===> router (TokenInbox)
      hello:  KEY_BYTES of the router's channel key
      frames: [u32 length][msgpack list of items], an item per event of a stream:
              [stream, token_ids, finish_reason, is_first, prefill_seconds, is_decode_start,
               replica_id, logprobs]

Every stream a replica serves for one router shares the connection: the events that an engine
step makes for all of them leave as one frame, written when the replica's loop has run every
stream's part of that step (no timer). The router learns where to send nothing else: a request's
`TokenRoute` (the router's address, its key, the stream's number) rides the Serve call that
starts it, and Serve still routes, counts and cancels that call.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from engine.messages import TokenEvent

KEY_BYTES = 32
_LENGTH = struct.Struct("!I")
HEADER_BYTES = _LENGTH.size
# A frame past this is refused (a stream's worth of tokens for every stream of a step is far
# less): a corrupt length must not make the router buffer gigabytes.
MAX_FRAME_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class TokenRoute:
    """Where a request's events go: the router's channel (host, port), the key that opens it,
    and the stream's number there."""

    host: str
    port: int
    key: bytes
    stream: int

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)


def encode_item(stream: int, event: TokenEvent) -> list[Any]:
    return [
        stream,
        event.token_ids,
        event.finish_reason,
        event.is_first,
        event.prefill_seconds,
        event.is_decode_start,
        event.replica_id,
        event.logprobs,
    ]


def decode_item(item: list[Any]) -> tuple[int, TokenEvent]:
    stream, ids, finish, is_first, prefill_s, is_decode_start, replica_id, logprobs = item
    if logprobs is not None:
        logprobs = tuple(tuple((int(t), float(lp)) for t, lp in entry) for entry in logprobs)
    event = TokenEvent(
        tuple(ids), finish, is_first, prefill_s, is_decode_start, replica_id, logprobs
    )
    return stream, event


def frame(items: list[list[Any]]) -> bytes:
    body = msgpack.packb(items, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body's length from a frame's header; ValueError past MAX_FRAME_BYTES."""
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a token frame of {length} bytes is past {MAX_FRAME_BYTES}")
    return int(length)


def unpack_items(body: bytes) -> list[tuple[int, TokenEvent]]:
    return [decode_item(item) for item in msgpack.unpackb(body, raw=False, use_list=True)]
