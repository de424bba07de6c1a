"""The load generator: Poisson arrivals at a rate (open loop) or a fixed number of requests in
flight (closed loop), one record per request, a progress bar on stderr."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass
from typing import Literal

from bench.record import RequestRecord
from bench.targets import Target
from bench.workload import BenchRequest


@dataclass(frozen=True)
class Arrival:
    kind: Literal["poisson", "closed"]
    value: float  # req/s for poisson, requests in flight for closed

    def __post_init__(self) -> None:
        if self.value <= 0:
            raise ValueError(f"{self.kind} arrival needs a value > 0, got {self.value}")
        if self.kind == "closed" and self.value != int(self.value):
            raise ValueError(f"concurrency must be a whole number, got {self.value}")

    @property
    def label(self) -> str:
        return f"{self.value:g} req/s" if self.kind == "poisson" else f"{self.value:g} in flight"


def poisson_offsets(rate: float, n: int, seed: int) -> list[float]:
    """Send times of n requests: the first at 0, then exponential gaps of mean 1/rate."""
    rng = random.Random(seed)
    offsets, at = [], 0.0
    for _ in range(n):
        offsets.append(at)
        at += rng.expovariate(rate)
    return offsets


async def run_load(
    target: Target,
    requests: list[BenchRequest],
    arrival: Arrival,
    seed: int = 0,
    progress: bool = True,
) -> list[RequestRecord]:
    """Send every request once; failures are recorded, never raised."""
    started = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - started

    records = [RequestRecord(r.index, r.prompt_tokens, r.max_tokens, 0.0) for r in requests]
    bar = _progress(len(requests), f"{target.name} {arrival.label}", progress)

    async def send(request: BenchRequest, record: RequestRecord) -> None:
        record.sent_s = clock()
        try:
            await target.send(request, record, clock)
            if not record.chunks:
                record.error = "no tokens came back"
        except Exception as exc:
            record.error = _describe(exc)
        bar.update(1)

    if arrival.kind == "poisson":

        async def scheduled(at: float, request: BenchRequest, record: RequestRecord) -> None:
            await asyncio.sleep(max(at - clock(), 0.0))
            await send(request, record)

        offsets = poisson_offsets(arrival.value, len(requests), seed)
        await asyncio.gather(*map(scheduled, offsets, requests, records))
    else:
        queue = list(zip(requests, records, strict=True))[::-1]

        async def worker() -> None:
            while queue:
                await send(*queue.pop())

        await asyncio.gather(*(worker() for _ in range(int(arrival.value))))
    bar.close()
    return records


async def warm_up(target: Target, requests: list[BenchRequest]) -> None:
    """Requests whose results are dropped: first-call costs (NIXL handshake, lazy imports,
    connection set-up) are not what a steady service shows. A failure here is an error."""
    for request in requests:
        record = RequestRecord(request.index, request.prompt_tokens, request.max_tokens, 0.0)
        await target.send(request, record, time.perf_counter)
        if not record.chunks:
            raise RuntimeError(f"{target.name}: a warm-up request returned no tokens")


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    if callable(code) and callable(details):  # grpc.RpcError
        return f"{code().name}: {details()}"
    return f"{type(exc).__name__}: {exc}"


def _progress(total: int, description: str, enabled: bool):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(
        total=total, desc=description, unit="req", file=sys.stderr, disable=not enabled, leave=False
    )
