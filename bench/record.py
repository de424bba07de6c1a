"""What one benchmark request saw: send time, the arrival of every streamed token, and the
server's own timing breakdown. The latencies are derived from those times, never stored twice.

    sent        first token            ...             last token
     |--- TTFT ---|-- gap --|-- gap --| ... |-- gap --|
     |------------------------- E2E -------------------|
    TPOT = (E2E - TTFT) / (output tokens - 1); the gaps are the inter-token latencies (ITL).

A chunk that carries k tokens spreads its gap evenly over them (k ITLs of gap / k), so the
ITLs of a request always sum to E2E - TTFT.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from prefill_workers.replica import prefilled_locally


@dataclass(frozen=True)
class ServerTimings:
    """The server's breakdown (pdserve.v1.Timings); None for a target that reports none."""

    queue_wait_s: float
    prefill_s: float
    kv_transfer_s: float
    ttft_s: float
    decode_start_s: float
    e2e_s: float
    # Where the prompt was computed: "local" (on its decode replica), "remote" (the prefill
    # pool), "" (colocated, or not reported; also records saved before this field).
    prefill_path: str = ""


def prefill_path_of(prefill_replica: str, decode_replica: str) -> str:
    """From pdserve.v1.Timings' replica ids: a disaggregated request's prompt computed by its
    decode replica is "local", by another replica "remote"."""
    if not decode_replica:
        return ""
    return "local" if prefilled_locally(prefill_replica, decode_replica) else "remote"


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int  # as the client built it; the server may count a BOS more
    max_tokens: int
    sent_s: float  # seconds since the run started
    # (seconds since the run started, tokens in the chunk) per chunk with at least one token
    chunks: list[tuple[float, int]] = field(default_factory=list)
    error: str | None = None
    server: ServerTimings | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] - self.sent_s if self.ok else None

    @property
    def e2e_s(self) -> float | None:
        return self.chunks[-1][0] - self.sent_s if self.ok else None

    @property
    def finished_s(self) -> float | None:
        return self.chunks[-1][0] if self.chunks else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if not self.ok or self.num_output_tokens < 2:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        gaps: list[float] = []
        first_at, first_n = self.chunks[0] if self.chunks else (0.0, 0)
        # Tokens beyond the first in the first chunk arrived with it: gaps of zero.
        gaps.extend([0.0] * max(first_n - 1, 0))
        previous = first_at
        for at, n in self.chunks[1:]:
            gaps.extend([(at - previous) / n] * n)
            previous = at
        return gaps

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        server = data.get("server")
        return cls(
            index=data["index"],
            prompt_tokens=data["prompt_tokens"],
            max_tokens=data["max_tokens"],
            sent_s=data["sent_s"],
            chunks=[(float(at), int(n)) for at, n in data["chunks"]],
            error=data.get("error"),
            server=ServerTimings(**server) if server is not None else None,
        )
