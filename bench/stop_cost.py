"""The router's cost per streamed token with and without stop strings, side by side.

    .venv/bin/python -m bench.stop_cost [--model tiny] [--tokens 1000]

Runs the router's Detokenizer over one real output of the model's tokenizer (the same token
ids for every case) and prints the mean microseconds per token: no stop strings, four short
ones, and the longest the router accepts (RequestLimits.max_stop_chars each) built to match
as late as possible. The stop strings never occur, so every case streams every token.
"""

from __future__ import annotations

import argparse
import time

from engine.models import resolve_model
from engine.prompts import load_tokenizer
from router.detokenizer import Detokenizer
from router.validation import MAX_STOP_SEQUENCES, RequestLimits

TEXT = (
    "The prefill pool computes the prompt's KV cache once and ships it to a decode replica, "
    "which streams the answer token by token while the router turns ids into text. "
)


def per_token_us(tokenizer: object, ids: list[int], stops: tuple[str, ...], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        detok = Detokenizer(tokenizer, stops)
        started = time.perf_counter()
        for token_id in ids:
            _, finish = detok.push((token_id,), None)
            assert finish is None
        best = min(best, time.perf_counter() - started)
    return best / len(ids) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(str(resolve_model(args.model)))
    ids = list(tokenizer(TEXT * 200)["input_ids"])[: args.tokens]
    longest = RequestLimits.max_stop_chars
    # Each long stop string shares all but its last character with text the output could end
    # with, so the held-back-prefix scan runs its full length on every token.
    cases = {
        "no stop strings": (),
        f"{MAX_STOP_SEQUENCES} short stop strings": ("\n\n", "###", "User:", "</s>"),
        f"{MAX_STOP_SEQUENCES} x {longest}-char stop strings": tuple(
            (TEXT * 4)[: longest - 1] + chr(0x2460 + i) for i in range(MAX_STOP_SEQUENCES)
        ),
    }
    base = None
    print(f"{len(ids)} tokens, best of {args.repeats}")
    for name, stops in cases.items():
        us = per_token_us(tokenizer, ids, stops, args.repeats)
        base = base or us
        print(f"  {name:32s} {us:8.1f} us/token  ({us / base:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
