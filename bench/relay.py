"""The token path's cost, beside its floor, in one run: `pdserve bench relay`.

    pdserve bench relay [--streams 64] [--tokens 256] [--target HOST:PORT] [--out DIR]

1. The floor: a bare `grpc.aio` server in a process of its own streams `--tokens` messages of
   the same shape (`GenerateResponse`, one token id and its text) to each of `--streams`
   concurrent calls of the same client. Its messages/s is what this host's gRPC can move.
2. pdserve: the same client sends `--streams` concurrent `Generate` calls (ignore_eos,
   max_tokens `--tokens`, greedy), a new one as each ends, to the local run (`pdserve up`) or
   `--target`. Output tokens/s, TTFT and TPOT (P50, P95), and the CPU seconds that every
   process of the run spent meanwhile (the run's Ray head and Redis and every process below
   them, read from /proc; the client is apart), per output token and per request.

A zero-time sim app (`pdserve up --engine sim --profile zero`) leaves pdserve's own cost: the
ratio of its tokens/s to the floor is the share of this host's gRPC rate pdserve reaches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from api.gen.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from bench.procfs import cpu_seconds_of, descendants
from bench.suite import machine_facts
from engine.autoscaling_stats import percentile
from engine.ports import free_port

PROMPT = "Count the pools."


@dataclass(frozen=True)
class StreamRun:
    """One closed-loop run of streams: what the client saw and what the server side spent."""

    system: str
    num_streams: int
    num_requests: int
    num_messages: int
    num_tokens: int
    seconds: float
    ttft_p50_s: float
    ttft_p95_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    server_cpu_s: float | None = None

    @property
    def messages_per_s(self) -> float:
        return self.num_messages / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def cpu_us_per_token(self) -> float | None:
        if self.server_cpu_s is None or not self.num_tokens:
            return None
        return self.server_cpu_s / self.num_tokens * 1e6

    @property
    def cpu_ms_per_request(self) -> float | None:
        if self.server_cpu_s is None or not self.num_requests:
            return None
        return self.server_cpu_s / self.num_requests * 1e3

    def summary(self) -> dict[str, Any]:
        return asdict(self) | {
            "messages_per_s": self.messages_per_s,
            "tokens_per_s": self.tokens_per_s,
            "cpu_us_per_token": self.cpu_us_per_token,
            "cpu_ms_per_request": self.cpu_ms_per_request,
        }


# --- CPU of a process tree, from /proc ---------------------------------------------------------


class TreeCPU:
    """CPU seconds a process tree spent between `start` and `stop` (processes that started
    meanwhile count from zero; those that ended meanwhile are lost)."""

    def __init__(self, roots: Iterable[int]) -> None:
        self._roots = list(roots)
        self._before: dict[int, float] = {}

    def start(self) -> None:
        self._before = cpu_seconds_of(descendants(self._roots))

    def stop(self) -> float:
        after = cpu_seconds_of(descendants(self._roots))
        return sum(s - self._before.get(pid, 0.0) for pid, s in after.items())


# --- the floor: a bare grpc.aio server ---------------------------------------------------------


class _FloorServicer(pdserve_pb2_grpc.PDServeServiceServicer):
    async def Generate(self, request: Any, context: Any) -> Any:
        n = request.max_tokens
        for i in range(n - 1):
            yield pdserve_pb2.GenerateResponse(
                request_id=request.request_id, text=" tok", token_ids=[1000 + i]
            )
        yield pdserve_pb2.GenerateResponse(
            request_id=request.request_id,
            text=" tok",
            token_ids=[1000 + n],
            finish_reason=pdserve_pb2.FINISH_REASON_LENGTH,
        )


def serve_bare(servicer: Any, port: int, ready: Any) -> None:
    """A bare `grpc.aio` server of `servicer` on loopback `port` (a process's target); sets
    `ready` once it listens."""

    async def main() -> None:
        server = grpc.aio.server()
        pdserve_pb2_grpc.add_PDServeServiceServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


# --- the client -------------------------------------------------------------------------------


async def drive(
    target: str,
    num_streams: int,
    num_tokens: int,
    num_requests: int,
    metadata: tuple[tuple[str, str], ...] = (),
    credentials: grpc.ChannelCredentials | None = None,
) -> tuple[int, int, float, list[float], list[float]]:
    """`num_requests` Generate calls, `num_streams` at a time; (messages, tokens, seconds,
    TTFTs, TPOTs)."""
    channel = (
        grpc.aio.secure_channel(target, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(target)
    )
    stub = pdserve_pb2_grpc.PDServeServiceStub(channel)
    ttfts: list[float] = []
    tpots: list[float] = []
    counts = [0, 0]
    remaining = [num_requests]

    async def one() -> None:
        request = pdserve_pb2.GenerateRequest(
            prompt=PROMPT, max_tokens=num_tokens, ignore_eos=True, temperature=0.0
        )
        sent = time.perf_counter()
        first = last = 0.0
        num = 0
        async for message in stub.Generate(request, metadata=metadata):
            now = time.perf_counter()
            first = first or now
            last = now
            counts[0] += 1
            num += len(message.token_ids)
        counts[1] += num
        ttfts.append(first - sent)
        if num > 1:
            tpots.append((last - first) / (num - 1))

    async def worker() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            await one()

    async with channel:
        await channel.channel_ready()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(num_streams)))
        seconds = time.perf_counter() - started
    return counts[0], counts[1], seconds, ttfts, tpots


def _run(
    system: str,
    target: str,
    args: argparse.Namespace,
    cpu: TreeCPU | None,
    metadata: tuple[tuple[str, str], ...] = (),
    credentials: grpc.ChannelCredentials | None = None,
) -> StreamRun:
    # A warm-up round first: connections, Serve's handles, the engines' first steps.
    asyncio.run(drive(target, args.streams, 8, args.streams, metadata, credentials))
    if cpu is not None:
        cpu.start()
    messages, tokens, seconds, ttfts, tpots = asyncio.run(
        drive(target, args.streams, args.tokens, args.requests, metadata, credentials)
    )
    server_cpu = cpu.stop() if cpu is not None else None
    return StreamRun(
        system,
        args.streams,
        args.requests,
        messages,
        tokens,
        seconds,
        percentile(ttfts, 50) or 0.0,
        percentile(ttfts, 95) or 0.0,
        percentile(tpots, 50) or 0.0,
        percentile(tpots, 95) or 0.0,
        server_cpu,
    )


def run_floor(args: argparse.Namespace) -> StreamRun:
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    server = spawn.Process(target=serve_bare, args=(_FloorServicer(), port, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the floor server did not start within 30 s")
        assert server.pid is not None
        return _run("grpc-floor", f"127.0.0.1:{port}", args, TreeCPU([server.pid]))
    finally:
        server.terminate()
        server.join(10)


def run_pdserve(args: argparse.Namespace) -> StreamRun:
    from deploy.local import client_api_key, load_run

    run = load_run()
    target = args.target or (run.grpc_target if run else "127.0.0.1:9000")
    key = client_api_key(args.api_key)
    metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {key}"),) if key else ()
    if run is not None and run.app:
        metadata += (("application", run.app),)
    roots = [run.ray_pid, run.redis_pid] if run is not None and not args.target else []
    cpu = TreeCPU(roots) if roots else None
    credentials = None
    roots_pem = run.tls_roots() if run is not None else None
    if roots_pem:
        credentials = grpc.ssl_channel_credentials(roots_pem)
    return _run(args.label, target, args, cpu, metadata, credentials)


def render(runs: list[StreamRun]) -> str:
    floor = next((r for r in runs if r.system == "grpc-floor"), None)
    lines = [
        "| system | streams | msgs/s | tokens/s | tokens/s of floor msgs/s | TTFT P50 | TPOT P50 "
        "| TPOT P95 | CPU/token | CPU/request |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        share = f"{r.tokens_per_s / floor.messages_per_s:.3f}" if floor else "-"
        per_token = f"{r.cpu_us_per_token:.0f} us" if r.cpu_us_per_token is not None else "-"
        per_req = f"{r.cpu_ms_per_request:.1f} ms" if r.cpu_ms_per_request is not None else "-"
        lines.append(
            f"| {r.system} | {r.num_streams} | {r.messages_per_s:.0f} | {r.tokens_per_s:.0f} "
            f"| {share} | {r.ttft_p50_s * 1e3:.1f} ms | {r.tpot_p50_s * 1e3:.2f} ms "
            f"| {r.tpot_p95_s * 1e3:.2f} ms | {per_token} | {per_req} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, default=64, help="calls in flight")
    parser.add_argument("--tokens", type=int, default=256, help="tokens (messages) per call")
    parser.add_argument("--requests", type=int, help="calls in all (default: 4 x --streams)")
    parser.add_argument("--target", help="gRPC host:port (default: the local run's)")
    parser.add_argument("--api-key", help="default: $PDSERVE_API_KEY, else the local run's")
    parser.add_argument("--label", default="pdserve", help="the system's name in the report")
    parser.add_argument("--no-floor", action="store_true", help="pdserve only")
    parser.add_argument("--floor-only", action="store_true", help="the bare floor only")
    parser.add_argument("--out", help="folder for relay.json and relay.md")


def run(args: argparse.Namespace) -> int:
    args.requests = args.requests or 4 * args.streams
    runs = []
    if not args.no_floor:
        runs.append(run_floor(args))
    if not args.floor_only:
        runs.append(run_pdserve(args))
    table = render(runs)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "relay.json").write_text(
            json.dumps(
                {**machine_facts(), "runs": [r.summary() for r in runs]},
                indent=2,
            )
            + "\n"
        )
        (out / "relay.md").write_text(table + "\n")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))


if __name__ == "__main__":
    main()
