"""The floor under bench.overload's refusal latencies: its own client against a bare grpc.aio
server (another process) that refuses every call at once, with no Serve, router or engine.

    .venv/bin/python -m bench.grpc_client_floor [--bursts 1,10,50,200] [--clients 1]

Prints one JSON line per burst: the wall time, and the refusal latency percentiles (ms) as
bench.overload measures them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from api.gen.pdserve.v1 import pdserve_pb2_grpc
from bench.overload import _burst_calls, _stream, burst_from_clients
from bench.relay import serve_bare
from engine.autoscaling_stats import percentile_of


class _Refusing(pdserve_pb2_grpc.PDServeServiceServicer):
    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        yield  # an async generator, as the streaming method must be


async def burst(target: str, size: int, clients: int = 1) -> dict[str, object]:
    if clients > 1:
        results, wall_s = await burst_from_clients(target, (), size, 8, clients)
    else:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pdserve_pb2_grpc.PDServeServiceStub(channel)
            await _stream(stub, "warm up the channel", 1, ())
            sent = time.perf_counter()
            results = await _burst_calls(stub, (), 0, size, 8)
            wall_s = time.perf_counter() - sent
    refused_ms = [1000 * s for _, s, _ in results]
    return {
        "burst": size,
        "clients": clients,
        "codes": sorted({code for code, _, _ in results}),
        "wall_ms": round(1000 * wall_s, 1),
        "refusal_ms": {
            name: round(percentile_of(refused_ms, q), 1) for name, q in (("p50", 50), ("p95", 95))
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bursts", default="1,10,50,200")
    parser.add_argument("--clients", type=int, default=1, help="processes sending each burst")
    args = parser.parse_args(argv)
    from deploy.local import free_port

    port = free_port()
    ready = multiprocessing.Event()
    server = multiprocessing.Process(
        target=serve_bare, args=(_Refusing(), port, ready), daemon=True
    )
    server.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the refusing server did not start in 30 s")
        for size in (int(b) for b in args.bursts.split(",")):
            print(json.dumps(asyncio.run(burst(f"127.0.0.1:{port}", size, args.clients))))
    finally:
        server.kill()
        server.join(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
