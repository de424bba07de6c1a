"""Do other streams slow down when some callers send the longest stop strings the router takes?

    .venv/bin/python -m bench.stop_attack [--victims 4] [--attackers 4] [--max-tokens 128]
                                          [--rounds 3] [--target HOST:PORT --api-key KEY]

Against a running app (default: the local run of `pdserve up`). Each round runs the same
`--victims` streams (no stop strings) twice, side by side with `--attackers` streams of the same
length: once where the attackers send no stop strings, once where each sends four stop strings
of `RequestLimits.max_stop_chars` characters that never match (the router scans them on every
token). The engines' load is the same in both; only the router's work differs. Rounds
alternate the order. Prints the victims' TPOT percentiles (client-side: time between tokens
after the first) for each case and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc

from api.gen.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from engine.autoscaling_stats import percentile_of
from router.validation import MAX_STOP_SEQUENCES, RequestLimits


def attack_stops(length: int = RequestLimits.max_stop_chars) -> list[str]:
    """Stop strings that never match and cost the most to scan: each starts with characters
    that occur everywhere in English text."""
    return [(" e" * length)[: length - 1] + chr(0x2603 + i) for i in range(MAX_STOP_SEQUENCES)]


async def _tpot(
    stub: pdserve_pb2_grpc.PDServeServiceStub,
    prompt: str,
    max_tokens: int,
    stops: list[str],
    metadata: tuple[tuple[str, str], ...],
) -> float:
    """Mean seconds between tokens after the first, measured at the client."""
    request = pdserve_pb2.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, ignore_eos=True, stop=stops
    )
    arrivals: list[float] = []
    async for chunk in stub.Generate(request, metadata=metadata, timeout=600):
        arrivals.extend(time.perf_counter() for _ in chunk.token_ids)
    if len(arrivals) < 2:
        raise RuntimeError(f"a stream returned {len(arrivals)} tokens")
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)


async def _case(
    stub: pdserve_pb2_grpc.PDServeServiceStub,
    victims: int,
    attackers: int,
    max_tokens: int,
    stops: list[str],
    metadata: tuple[tuple[str, str], ...],
) -> list[float]:
    calls = [
        _tpot(stub, f"Story {i}: once upon a time", max_tokens, [], metadata)
        for i in range(victims)
    ] + [
        _tpot(stub, f"Essay {i}: the weather", max_tokens, stops, metadata)
        for i in range(attackers)
    ]
    return list(await asyncio.gather(*calls))[:victims]


async def run(
    target: str,
    metadata: tuple[tuple[str, str], ...],
    victims: int,
    attackers: int,
    max_tokens: int,
    rounds: int,
) -> dict[str, object]:
    plain: list[float] = []
    attacked: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pdserve_pb2_grpc.PDServeServiceStub(channel)
        for r in range(rounds):
            order = [(plain, []), (attacked, attack_stops())]
            for into, stops in order if r % 2 == 0 else order[::-1]:
                into.extend(await _case(stub, victims, attackers, max_tokens, stops, metadata))

    def summary(values: list[float]) -> dict[str, float]:
        ms = [1000 * v for v in values]
        return {f"p{q}": round(percentile_of(ms, q), 1) for q in (50, 95)}

    plain_s, attacked_s = summary(plain), summary(attacked)
    return {
        "target": target,
        "victims": victims,
        "attackers": attackers,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "stop_chars": RequestLimits.max_stop_chars,
        "victim_tpot_ms_attackers_without_stops": plain_s,
        "victim_tpot_ms_attackers_with_stops": attacked_s,
        "ratio_p50": round(attacked_s["p50"] / plain_s["p50"], 3),
        "ratio_p95": round(attacked_s["p95"] / plain_s["p95"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="HOST:PORT of a gRPC endpoint (default: the local run)")
    parser.add_argument("--api-key")
    parser.add_argument("--victims", type=int, default=4)
    parser.add_argument("--attackers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from bench.targets import grpc_endpoint

    target, metadata = grpc_endpoint(args.target, args.api_key)
    if target is None:
        parser.error("no --target and no local run")
    report = asyncio.run(
        run(target, metadata, args.victims, args.attackers, args.max_tokens, args.rounds)
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
