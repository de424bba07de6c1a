"""The router's CPU per streamed token against the answer's length, side by side.

    .venv/bin/python -m bench.router_cost [--model default] [--lengths 50,2000] [--repeats 3]

One request at a time goes through the router's own path, in this process: the RouterService
(validation, tokenizing, admission, timings, detokenizer) and the OpenAI SSE encoding of every
chunk. The engines are replaced by a replay of real token ids of the model's tokenizer, one per
event as the decode pool sends them, so what is measured is the router's CPU alone
(time.process_time; best of the repeats). A router whose cost per token grows with the
answer (re-decoding all the output on every token did) shows it as the ratio to the shortest.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator

from engine.messages import GenerationRequest, TokenEvent
from engine.models import resolve_model
from engine.prompts import load_tokenizer
from router.admission import AdmissionLimits
from router.openai_api import Reply, merged, sse_events
from router.service import RouterService
from router.validation import RequestLimits

TEXT = (
    "The prefill pool computes the prompt's KV cache once and ships it to a decode replica, "
    "which streams the answer token by token while the router turns ids into text. "
)


class ReplayEngines:
    """The engines' side of a stream: the first token as prefill sends it, then one event per
    token, then the finish reason on the last."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        ids = self.token_ids[: request.params.max_tokens]
        yield TokenEvent((ids[0],), None, is_first=True, replica_id="prefill-0")
        yield TokenEvent((), None, is_decode_start=True)
        for i, token_id in enumerate(ids[1:], start=2):
            yield TokenEvent((token_id,), "length" if i == len(ids) else None)


async def cpu_per_token_us(service: RouterService, num_tokens: int) -> float:
    body = {"model": "m", "prompt": "Tell me about the pools.", "max_tokens": num_tokens}
    body |= {"stream": True, "ignore_eos": True}
    started = time.process_time()
    prepared = await service.prepare_async(body, "bench-1")
    chunks = service.stream(prepared)
    first = await anext(chunks)
    num_bytes = 0
    reply = Reply([prepared], "cmpl-bench-1", 0)
    async for event in sse_events(reply, first, merged([chunks])):
        num_bytes += len(event)
    assert num_bytes > 0
    return (time.process_time() - started) / num_tokens * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--lengths", default="50,2000")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    tokenizer = load_tokenizer(str(resolve_model(args.model)))
    ids = list(tokenizer(TEXT * (max(lengths) // 20 + 1))["input_ids"])
    assert len(ids) >= max(lengths)
    service = RouterService(
        tokenizer,
        RequestLimits(served_models=frozenset({"m"}), default_model="m"),
        AdmissionLimits(max_in_flight=8, max_queued_prompt_tokens=100_000),
        max_model_len=max(lengths) + 1024,
        engines=ReplayEngines(ids),
    )
    print(f"router CPU per token ({args.model}'s tokenizer), best of {args.repeats}")
    base = None
    for n in lengths:
        us = min(asyncio.run(cpu_per_token_us(service, n)) for _ in range(args.repeats))
        base = base or us
        print(f"  {n:6d} tokens: {us:8.1f} us/token  ({us / base:.2f}x the first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
