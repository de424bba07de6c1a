"""Protobuf messages <-> the plain data the router works on. Pure: no grpc, no I/O.

- `request_to_body(GenerateRequest | CompleteRequest)`: the dict
  `router.validation.validate_request` takes, so a gRPC request and an HTTP JSON body pass
  through exactly the same validation. An enum field at UNSPECIFIED or at a number this server
  does not know raises `InvalidField` naming it (INVALID_ARGUMENT at the edge).
- `usage_message(...)`, `timings_message(...)`, `finish_reason_value(...)`, `pools_message(...)`:
  the response parts the router fills in.
- `role_value(...)`, `finish_reason_name(...)`: for clients, the other way.

The contract's closed sets are enums; inside, the router keeps the strings that HTTP and vLLM
use. The two are tied by name, `ROLE_USER` <-> "user", `FINISH_REASON_STOP` <-> "stop",
`POOL_PREFILL` <-> "prefill" (deploy's pool names), so a value added to the proto needs no table
here.

proto3 gives scalars no presence, but the `optional` fields of GenerateRequest have it: an
unset field is left out of the body (the server's default applies), while an explicit value,
0 included, is put in and validated, so `max_tokens: 0` is an error rather than "unset".
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Mapping
from typing import Any, Protocol

from api.gen.pdserve.v1 import pdserve_pb2

GenerateOrComplete = pdserve_pb2.GenerateRequest | pdserve_pb2.CompleteRequest


class InvalidField(ValueError):
    """A request field that has no meaning here (an enum left UNSPECIFIED, or an unknown number).

    The router answers it as it answers `router.validation.InvalidRequest`: INVALID_ARGUMENT
    with "field: message".
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


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


def request_to_body(msg: GenerateOrComplete) -> dict[str, Any]:
    """The request as a body for `validate_request`; `request_id` stays on the message."""
    body: dict[str, Any] = {}
    if msg.model:
        body["model"] = msg.model
    # proto3 cannot tell an empty prompt from a missing one; with no messages either, pass
    # the empty prompt on so validation rejects it under the field name `prompt`.
    if msg.prompt or not msg.messages:
        body["prompt"] = msg.prompt
    if msg.messages:
        body["messages"] = [
            {"role": _role_name(f"messages[{i}].role", m.role), "content": m.content}
            for i, m in enumerate(msg.messages)
        ]
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


def role_value(role: str, field: str = "role") -> pdserve_pb2.Role:
    """`Role` of a chat role as HTTP spells it ("user" -> ROLE_USER); ValueError naming `field`
    for a role the contract has no value for."""
    value = _value(pdserve_pb2.Role, "ROLE_", role)
    if value is None:
        allowed = ", ".join(
            _name(pdserve_pb2.Role, "ROLE_", v)
            for v in pdserve_pb2.Role.values()
            if v != pdserve_pb2.ROLE_UNSPECIFIED
        )
        raise InvalidField(field, f"must be one of {allowed}, got {role!r}")
    return value


def finish_reason_value(finish_reason: str | None) -> pdserve_pb2.FinishReason:
    """`FinishReason` of the router's finish reason: None (not finished) -> UNSPECIFIED.

    Any other string is a finish the contract cannot express: a server bug, raised rather than
    sent as a finished or unfinished chunk.
    """
    if finish_reason is None:
        return pdserve_pb2.FINISH_REASON_UNSPECIFIED
    value = _value(pdserve_pb2.FinishReason, "FINISH_REASON_", finish_reason)
    if value is None:
        raise ValueError(f"finish reason {finish_reason!r} has no pdserve.v1.FinishReason value")
    return value


def finish_reason_name(value: pdserve_pb2.FinishReason) -> str:
    """The reason as HTTP names it, "stop" or "length"; "" while unfinished (UNSPECIFIED)."""
    if value == pdserve_pb2.FINISH_REASON_UNSPECIFIED:
        return ""
    return _name(pdserve_pb2.FinishReason, "FINISH_REASON_", value)


def pools_message(ready_replicas: Mapping[str, int]) -> list[pdserve_pb2.PoolReplicas]:
    """Running replicas per pool, keyed by pool name ("prefill", "decode", "engine"), as
    `PoolReplicas` in the enum's order (prefill before decode)."""
    pools = []
    for name, count in ready_replicas.items():
        pool = _value(pdserve_pb2.Pool, "POOL_", name)
        if pool is None:
            raise ValueError(f"pool {name!r} has no pdserve.v1.Pool value")
        pools.append(pdserve_pb2.PoolReplicas(pool=pool, ready_replicas=count))
    return sorted(pools, key=lambda p: p.pool)


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


def _role_name(field: str, value: int) -> str:
    roles = [v.name for v in pdserve_pb2.Role.DESCRIPTOR.values if v.number != 0]
    if value == pdserve_pb2.ROLE_UNSPECIFIED:
        raise InvalidField(field, f"is required: one of {', '.join(roles)}")
    if value not in pdserve_pb2.Role.values():  # proto3 enums are open: any number parses
        raise InvalidField(field, f"must be one of {', '.join(roles)}, got Role value {value}")
    return _name(pdserve_pb2.Role, "ROLE_", value)


def _value(enum: Any, prefix: str, name: str) -> Any:
    """The enum's value for a lower-case name ("stop" -> FINISH_REASON_STOP); None if none
    (UNSPECIFIED is no name: it means "not set")."""
    if not isinstance(name, str) or name != name.lower() or name in ("", "unspecified"):
        return None
    try:
        return enum.Value(prefix + name.upper())
    except ValueError:
        return None


def _name(enum: Any, prefix: str, value: int) -> str:
    return str(enum.Name(value)).removeprefix(prefix).lower()


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
