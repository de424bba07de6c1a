"""Protobuf messages <-> the plain data the router works on. Pure: no grpc, no I/O.

- `request_to_body(GenerateRequest)`: the dict `router.validation.validate_request` takes, so a
  gRPC request and an HTTP JSON body pass through exactly the same validation.
- `usage_message(...)`, `timings_message(...)`: the response parts the router fills in.

proto3 gives scalars no presence, but the `optional` fields of GenerateRequest have it: an
unset field is left out of the body (the server's default applies), while an explicit value,
0 included, is put in and validated, so `max_tokens: 0` is an error rather than "unset".
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any, Protocol

from api.gen import pdserve_pb2


class TimingsLike(Protocol):
    """What `timings_message` reads: `router.timings.RequestTimings` or anything shaped like it."""

    @property
    def queue_wait_s(self) -> float: ...
    @property
    def prefill_s(self) -> float: ...
    @property
    def kv_transfer_s(self) -> float: ...
    @property
    def ttft_s(self) -> float: ...
    @property
    def decode_start_s(self) -> float: ...
    @property
    def mean_tpot_s(self) -> float: ...
    @property
    def e2e_s(self) -> float: ...
    @property
    def router_replica(self) -> str: ...
    @property
    def prefill_replica(self) -> str: ...
    @property
    def decode_replica(self) -> str: ...


def request_to_body(msg: pdserve_pb2.GenerateRequest) -> dict[str, Any]:
    """The request as a body for `validate_request`; `request_id` stays on the message."""
    body: dict[str, Any] = {}
    if msg.model:
        body["model"] = msg.model
    # proto3 cannot tell an empty prompt from a missing one; with no messages either, pass
    # the empty prompt on so validation rejects it under the field name `prompt`.
    if msg.prompt or not msg.messages:
        body["prompt"] = msg.prompt
    if msg.messages:
        body["messages"] = [{"role": m.role, "content": m.content} for m in msg.messages]
    if msg.HasField("max_tokens"):
        body["max_tokens"] = msg.max_tokens
    if msg.HasField("temperature"):
        body["temperature"] = _from_float32(msg.temperature)
    if msg.HasField("top_p"):
        body["top_p"] = _from_float32(msg.top_p)
    if msg.HasField("top_k"):
        body["top_k"] = msg.top_k
    if msg.HasField("seed"):
        body["seed"] = msg.seed
    if msg.stop:
        body["stop"] = list(msg.stop)
    if msg.HasField("ignore_eos"):
        body["ignore_eos"] = msg.ignore_eos
    return body


def usage_message(prompt_tokens: int, completion_tokens: int) -> pdserve_pb2.Usage:
    return pdserve_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


def timings_message(timings: TimingsLike) -> pdserve_pb2.Timings:
    return pdserve_pb2.Timings(
        queue_wait_s=timings.queue_wait_s,
        prefill_s=timings.prefill_s,
        kv_transfer_s=timings.kv_transfer_s,
        ttft_s=timings.ttft_s,
        decode_start_s=timings.decode_start_s,
        mean_tpot_s=timings.mean_tpot_s,
        e2e_s=timings.e2e_s,
        router_replica=timings.router_replica,
        prefill_replica=timings.prefill_replica,
        decode_replica=timings.decode_replica,
    )


def _from_float32(value: float) -> float:
    """The shortest decimal that is the same float32: what the client typed.

    A proto `float` is 32-bit, so temperature 0.7 arrives as 0.699999988079071. Reading it back
    as 0.7 makes a gRPC request sample exactly like the same HTTP request, and keeps error
    messages in the client's own numbers ("got 2.1", not "got 2.0999999046325684").
    """
    as_float32 = struct.pack("<f", value)
    for digits in range(1, 10):  # 9 significant digits always round-trip a float32
        candidate = float(f"{value:.{digits}g}")
        with contextlib.suppress(OverflowError):  # a candidate past the float32 range
            if struct.pack("<f", candidate) == as_float32:
                return candidate
    return value
