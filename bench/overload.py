"""A burst far past admission against a running app: how fast the excess is refused, whether
the admitted streams finish, and what the burst costs the router's memory.

    .venv/bin/python -m bench.overload [--hold 20] [--burst 200] [--max-tokens 64]
                                       [--clients 1] [--target HOST:PORT --api-key KEY]

`--hold` streams (`--max-tokens` each) are opened first and each waits for its first token
(admitted); then `--burst` more are sent at once. The app's router should admit `--hold`
requests (its `router.max_in_flight`), so every burst stream is over capacity: each should end
with RESOURCE_EXHAUSTED, and the time from sending it to that status is the refusal latency.
`--clients N` sends the burst from N client processes (each with its own channel, 1/N of the
calls, all released at one instant): one Python client alone needs about 0.4 ms of its core per
call, so a burst of 200 from one client waits on the client itself (bench/grpc_client_floor.py).
The held streams must all finish with `--max-tokens` tokens. Without --target it runs against
the local run of `pdserve up` and reads the RSS of that run's router replica and of Serve's
proxy before and after the burst (and their peaks) from /proc.

Prints one JSON object: the codes seen, refusal latency percentiles (ms), held streams finished,
and the router's memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc

from api.gen.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from engine.autoscaling_stats import percentile_of


def _actor_pid(run_id: str, name: str) -> int | None:
    """The PID of the run's Ray actor process named `name` ("ServeReplica:<app>:Router",
    "ProxyActor")."""
    from deploy.local import marked_pids

    for pid in marked_pids(run_id):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"ray::{name}".encode()):
                return pid
        except OSError:
            continue
    return None


def _memory_kib(pid: int | None) -> dict[str, int]:
    if pid is None:
        return {}
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


async def _stream(
    stub: pdserve_pb2_grpc.PDServeServiceStub,
    prompt: str,
    max_tokens: int,
    metadata: tuple[tuple[str, str], ...],
    first: asyncio.Event | None = None,
) -> tuple[str, float, int]:
    """(status code name, seconds to the first message or the status, tokens received)."""
    request = pdserve_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    answered = None
    tokens = 0
    call = stub.Generate(request, metadata=metadata, timeout=300)
    try:
        async for chunk in call:
            if answered is None:
                answered = time.perf_counter() - started
                if first is not None:
                    first.set()
            tokens += len(chunk.token_ids)
        return "OK", answered or 0.0, tokens
    except grpc.aio.AioRpcError as error:
        return error.code().name, answered or time.perf_counter() - started, tokens
    finally:
        if first is not None:
            first.set()  # a held stream refused or ended early does not block the burst


async def _burst_calls(
    stub: pdserve_pb2_grpc.PDServeServiceStub,
    metadata: tuple[tuple[str, str], ...],
    first: int,
    count: int,
    max_tokens: int,
) -> list[tuple[str, float, int]]:
    return await asyncio.gather(
        *(_stream(stub, f"burst {i}", max_tokens, metadata) for i in range(first, first + count))
    )


def _burst_client(
    target: str,
    metadata: tuple[tuple[str, str], ...],
    first: int,
    count: int,
    max_tokens: int,
    start_at: float,
) -> tuple[list[tuple[str, float, int]], float]:
    """One client process's part of a burst: its own channel, connected before `start_at`
    (unix seconds), then `count` calls at once at that instant. Its results, and the seconds
    from `start_at` to the last one."""

    async def main() -> tuple[list[tuple[str, float, int]], float]:
        async with grpc.aio.insecure_channel(target) as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout=30)
            stub = pdserve_pb2_grpc.PDServeServiceStub(channel)
            await asyncio.sleep(max(0.0, start_at - time.time()))
            results = await _burst_calls(stub, metadata, first, count, max_tokens)
            return results, time.time() - start_at

    return asyncio.run(main())


async def burst_from_clients(
    target: str,
    metadata: tuple[tuple[str, str], ...],
    burst: int,
    max_tokens: int,
    clients: int,
    lead_s: float = 3.0,
) -> tuple[list[tuple[str, float, int]], float]:
    """`burst` calls split over `clients` processes, all released `lead_s` from now (time for
    the processes to start and connect); the results, and the burst's wall seconds."""
    import concurrent.futures
    import multiprocessing

    start_at = time.time() + lead_s
    shares = [burst // clients + (1 if i < burst % clients else 0) for i in range(clients)]
    firsts = [sum(shares[:i]) for i in range(clients)]
    context = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    with concurrent.futures.ProcessPoolExecutor(clients, mp_context=context) as pool:
        parts = await asyncio.gather(
            *(
                loop.run_in_executor(
                    pool, _burst_client, target, metadata, first, share, max_tokens, start_at
                )
                for first, share in zip(firsts, shares, strict=True)
                if share
            )
        )
    return [result for results, _ in parts for result in results], max(s for _, s in parts)


async def run(
    target: str,
    metadata: tuple[tuple[str, str], ...],
    hold: int,
    burst: int,
    max_tokens: int,
    router_pid: int | None = None,
    burst_max_tokens: int = 8,
    proxy_pid: int | None = None,
    router_in_flight: Callable[[], int] | None = None,
    clients: int = 1,
) -> dict[str, object]:
    """The burst against `target` (`metadata` on every call: the key, the application);
    `router_pid`, `proxy_pid`: whose memory to read (None: not read); `router_in_flight`: asks
    the router how many requests it holds, right after the burst (None: not asked); `clients`:
    processes the burst is sent from (1: this one, on the held streams' channel)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pdserve_pb2_grpc.PDServeServiceStub(channel)
        firsts = [asyncio.Event() for _ in range(hold)]
        held = [
            asyncio.ensure_future(
                _stream(stub, f"held stream {i}: tell me a story", max_tokens, metadata, firsts[i])
            )
            for i in range(hold)
        ]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), timeout=600)
        before, proxy_before = _memory_kib(router_pid), _memory_kib(proxy_pid)
        if clients > 1:
            results, burst_s = await burst_from_clients(
                target, metadata, burst, burst_max_tokens, clients
            )
        else:
            sent = time.perf_counter()
            results = await _burst_calls(stub, metadata, 0, burst, burst_max_tokens)
            burst_s = time.perf_counter() - sent
        # Still streaming when the last burst call ended: the burst met a full router.
        held_open = sum(1 for task in held if not task.done())
        # The router's own count: a held stream the client still reads may be done there.
        in_flight = None if router_in_flight is None else await asyncio.to_thread(router_in_flight)
        after, proxy_after = _memory_kib(router_pid), _memory_kib(proxy_pid)
        held_results = await asyncio.gather(*held)
    refused_ms = [1000 * s for code, s, _ in results if code == "RESOURCE_EXHAUSTED"]
    return {
        "target": target,
        "hold": hold,
        "burst": burst,
        "clients": clients,
        "burst_codes": dict(Counter(code for code, _, _ in results)),
        "burst_wall_s": round(burst_s, 3),
        "refusal_ms": {
            name: round(percentile_of(refused_ms, q), 1)
            for name, q in (("p50", 50), ("p95", 95), ("p99", 99), ("max", 100))
        }
        if refused_ms
        else {},
        "held_open_after_burst": held_open,
        "router_in_flight_after_burst": in_flight,
        "held_codes": dict(Counter(code for code, _, _ in held_results)),
        "held_full": sum(1 for code, _, n in held_results if code == "OK" and n == max_tokens),
        "router_rss_kib": {
            "before": before.get("VmRSS"),
            "after": after.get("VmRSS"),
            "peak": after.get("VmHWM"),
        },
        # Serve's proxy: where the burst's calls are refused when its in-flight gate is on.
        "proxy_rss_kib": {
            "before": proxy_before.get("VmRSS"),
            "after": proxy_after.get("VmRSS"),
            "peak": proxy_after.get("VmHWM"),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="HOST:PORT of a gRPC endpoint (default: the local run)")
    parser.add_argument("--api-key")
    parser.add_argument("--hold", type=int, default=20)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64, help="of each held stream")
    parser.add_argument("--clients", type=int, default=1, help="processes sending the burst")
    args = parser.parse_args(argv)
    from bench.targets import grpc_endpoint
    from deploy.local import load_run

    target, metadata = grpc_endpoint(args.target, args.api_key)
    if target is None:
        parser.error("no --target and no local run")
    run_state = None if args.target else load_run()
    pid = proxy_pid = None
    if run_state is not None:
        pid = _actor_pid(run_state.run_id, f"ServeReplica:{run_state.app}:Router")
        proxy_pid = _actor_pid(run_state.run_id, "ProxyActor")
    report = asyncio.run(
        run(
            target,
            metadata,
            args.hold,
            args.burst,
            args.max_tokens,
            pid,
            proxy_pid=proxy_pid,
            clients=args.clients,
        )
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
