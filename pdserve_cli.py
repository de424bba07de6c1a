"""The `pdserve` command: deploy's sub-commands (up, down, status, generate, slo, scale, model)
and bench's (bench run, compare, report) in one parser.

A module of its own, the top layer: bench starts apps through deploy/, so deploy/ cannot import
bench to offer its sub-commands; this module imports both (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bench.cli import add_bench_commands
from deploy import cli


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser(add_bench_commands)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
