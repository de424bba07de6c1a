"""Per-request timings as the router measures them, all offsets from the request's arrival.

    arrival      prefill call                first token sent  decode call          last token
      |--- queue_wait ---|-- prefill --|           |                |--kv_transfer+1st step--| ...
      |<-------------------- ttft ------------------>|
                                                   decode_start_s = decode call - arrival

`queue_wait_s` is everything before the prefill engine started computing: admission, routing,
the hop and the engine's own queue. `kv_transfer_s` is the time from the decode call to the
decode pool's first token, which also holds one decode step (`first_decode_token` takes the
decode engine's own figure instead, where a caller has one). The wire form and its field
comments: `Timings` in api/pdserve.proto.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RequestTimings:
    queue_wait_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    ttft_s: float = 0.0
    decode_start_s: float = 0.0
    mean_tpot_s: float = 0.0
    e2e_s: float = 0.0
    # Who served: the router replica, and the engine replicas of each phase ("" until known;
    # colocated: the engine in prefill_replica).
    router_replica: str = ""
    prefill_replica: str = ""
    decode_replica: str = ""


class TimingClock:
    """Collects one request's timings; `snapshot()` is what the next streamed message carries."""

    def __init__(self, router_replica: str = "") -> None:
        self.arrival = time.perf_counter()
        self._timings = RequestTimings(router_replica=router_replica)
        self._first_token_at: float | None = None
        self._num_tokens = 0

    def since_arrival(self) -> float:
        return time.perf_counter() - self.arrival

    def prefill_done(self, prefill_call_s: float, prefill_compute_s: float) -> None:
        compute = min(prefill_compute_s, prefill_call_s)
        self._timings = replace(
            self._timings,
            queue_wait_s=self.since_arrival() - compute,
            prefill_s=compute,
        )

    def tokens_sent(self, num_tokens: int) -> None:
        now = self.since_arrival()
        if self._first_token_at is None and num_tokens:
            self._first_token_at = now
            self._timings = replace(self._timings, ttft_s=now)
        self._num_tokens += num_tokens
        self._timings = replace(self._timings, e2e_s=now)

    def served_by(self, replica_id: str, prefill: bool) -> None:
        """The engine replica of one phase, from the first event it sent."""
        if prefill:
            self._timings = replace(self._timings, prefill_replica=replica_id)
        else:
            self._timings = replace(self._timings, decode_replica=replica_id)

    def decode_started(self) -> None:
        self._timings = replace(self._timings, decode_start_s=self.since_arrival())

    def first_decode_token(self, kv_transfer_s: float | None) -> None:
        """The decode pool's first token: the KV transfer is over. Without a decode call (the
        colocated topology) nothing was transferred and the field stays 0."""
        if self._timings.decode_start_s == 0.0:
            return
        if kv_transfer_s is None:
            kv_transfer_s = self.since_arrival() - self._timings.decode_start_s
        self._timings = replace(self._timings, kv_transfer_s=kv_transfer_s)

    def snapshot(self) -> RequestTimings:
        return self._timings

    def finish(self) -> RequestTimings:
        timings = self._timings
        if self._first_token_at is not None and self._num_tokens > 1:
            tpot = (timings.e2e_s - self._first_token_at) / (self._num_tokens - 1)
            timings = replace(timings, mean_tpot_s=tpot)
        self._timings = timings
        return timings

    @property
    def num_tokens(self) -> int:
        return self._num_tokens
