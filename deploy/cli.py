"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from engine.models import builtin_names, resolve_model


def _cmd_model_prepare(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    path = resolve_model(args.name)
    print(f"{args.name}: {path} ({time.perf_counter() - started:.1f} s)")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.local import LocalEngine
    from engine.params import GenerationParams
    from engine.platform import detect_device
    from engine.settings import EngineSettings

    params = GenerationParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    device = detect_device()
    settings = EngineSettings(
        model=resolve_model(args.model),
        device=device,
        dtype=args.dtype,
        block_size=32 if device == "cpu" else None,
        kv_cache_memory_bytes=256 * 1024**2 if device == "cpu" else None,
    )
    engine = LocalEngine(settings)
    prompt_ids = engine.encode(args.prompt, chat=args.chat)
    completion = engine.generate([prompt_ids], params)[0]
    print(completion.text)
    print(
        f"[{len(prompt_ids)} prompt tokens, {len(completion.token_ids)} generated, "
        f"finish={completion.finish_reason}, engine start {engine.start_seconds:.1f} s]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="generate a completion with a local engine")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument(
        "--model",
        default="default",
        help=f"built-in name ({', '.join(builtin_names())}) or a local HF folder",
    )
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="engine dtype; bfloat16 is faster but flips near-tie greedy answers",
    )
    gen.set_defaults(func=_cmd_generate)

    model = commands.add_parser("model", help="prepare built-in models")
    model_commands = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    prepare = model_commands.add_parser(
        "prepare", help="build or convert a built-in model into the cache (once)"
    )
    prepare.add_argument("name", choices=builtin_names())
    prepare.set_defaults(func=_cmd_model_prepare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
