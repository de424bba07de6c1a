"""KV transfer benchmark: bytes, time and bandwidth of each backend, against a plain memcpy of
the same bytes and against the prefill time, measured side by side in one run.

    python -m bench.transfer --backends nixl ray --lengths 128 256 512 1024 2048 4096

One prefill engine (core 0) and one decode engine (core 1) per backend, the default model in
float32. Each prompt is fresh random tokens, so no prefix-cache hit shortens a transfer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.memcpy import memcpy_seconds
from decode_workers.worker import DecodeWorker
from engine.messages import GenerationRequest
from engine.models import resolve_model
from engine.params import GenerationParams
from engine.settings import EngineSettings
from kv_transfer.base import TransferSettings
from prefill_workers.worker import PrefillWorker


@dataclass(frozen=True)
class TransferRow:
    backend: str
    prompt_tokens: int
    kv_bytes: int
    transfer_s: float
    prefill_s: float
    memcpy_s: float

    @property
    def gb_per_s(self) -> float:
        return self.kv_bytes / self.transfer_s / 1e9

    @property
    def memcpy_gb_per_s(self) -> float:
        return self.kv_bytes / self.memcpy_s / 1e9

    @property
    def ratio_to_memcpy(self) -> float:
        return self.gb_per_s / self.memcpy_gb_per_s

    @property
    def share_of_prefill(self) -> float:
        return self.transfer_s / self.prefill_s


async def _measure_one(
    prefill: PrefillWorker, decode: DecodeWorker, prompt: tuple[int, ...], tag: str
) -> tuple[float, float, int]:
    """(prefill seconds, transfer seconds, bytes) of one request, from the connector's stats."""
    request = GenerationRequest(tag, prompt, GenerationParams(max_tokens=2, ignore_eos=True))
    decode.stats.take_transfers()
    result = await prefill.prefill(request)
    async for _ in decode.decode(request, result.handoff):
        pass
    for _ in range(50):  # stats arrive with the engine step after the load
        samples = decode.stats.take_transfers()
        if samples:
            break
        await asyncio.sleep(0.02)
    else:
        raise RuntimeError(f"{tag}: the decode engine reported no KV transfer")
    return (
        result.prefill_seconds,
        sum(s.seconds for s in samples),
        sum(s.num_bytes for s in samples),
    )


async def run_backend(
    backend: str, settings: TransferSettings, model: Path, lengths: list[int], repeats: int
) -> list[TransferRow]:
    engine = EngineSettings(
        model=model, max_model_len=max(lengths) + 64, kv_cache_memory_bytes=512 * 1024**2
    )
    prefill = PrefillWorker(replace(engine, cpu_cores=(0,)), settings)
    decode = DecodeWorker(replace(engine, cpu_cores=(1,)), settings)
    prefill.start()
    decode.start()
    rng = random.Random(0)
    rows = []
    try:
        await _measure_one(prefill, decode, (5, 6, 7), f"{backend}-warmup")  # handshake
        for length in lengths:
            runs = []
            for i in range(repeats):
                prompt = tuple(rng.randrange(100, 40_000) for _ in range(length))
                runs.append(await _measure_one(prefill, decode, prompt, f"{backend}-{length}-{i}"))
            kv_bytes = int(statistics.median(r[2] for r in runs))
            rows.append(
                TransferRow(
                    backend=backend,
                    prompt_tokens=length,
                    kv_bytes=kv_bytes,
                    transfer_s=statistics.median(r[1] for r in runs),
                    prefill_s=statistics.median(r[0] for r in runs),
                    memcpy_s=memcpy_seconds(kv_bytes),
                )
            )
            print(_format_row(rows[-1]), flush=True)
    finally:
        prefill.shutdown()
        decode.shutdown()
    return rows


HEADER = (
    "| backend | prompt tokens | KV MB | transfer ms | GB/s | memcpy GB/s | vs memcpy "
    "| prefill ms | transfer / prefill |\n|---|---|---|---|---|---|---|---|---|"
)


def _format_row(row: TransferRow) -> str:
    return (
        f"| {row.backend} | {row.prompt_tokens} | {row.kv_bytes / 1e6:.1f} | "
        f"{row.transfer_s * 1e3:.1f} | {row.gb_per_s:.2f} | {row.memcpy_gb_per_s:.2f} | "
        f"{row.ratio_to_memcpy:.2f} | {row.prefill_s * 1e3:.0f} | {row.share_of_prefill:.1%} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["nixl", "ray"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="default")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here as JSON")
    args = parser.parse_args()

    model = resolve_model(args.model)
    rows: list[TransferRow] = []
    print(HEADER, flush=True)
    for backend in args.backends:
        settings = TransferSettings(backend=backend)
        if backend == "ray":
            from kv_transfer.ray_cluster import start_local_transfer_cluster

            settings = start_local_transfer_cluster(settings)
        rows += asyncio.run(run_backend(backend, settings, model, args.lengths, args.repeats))
    if args.json:
        payload = [
            asdict(r)
            | {
                "gb_per_s": r.gb_per_s,
                "ratio_to_memcpy": r.ratio_to_memcpy,
                "share_of_prefill": r.share_of_prefill,
            }
            for r in rows
        ]
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
