"""`pdserve plan`: every candidate topology's predicted goodput for a workload on a number of
engines, and the pick (deploy/plan.py); what `topology: auto` deploys."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path


def add_plan_command(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan", help="predict each topology's goodput for a workload and SLO; pick one"
    )
    plan.add_argument("--workload", help="named workload (deploy/workloads/) or YAML path")
    plan.add_argument("--profile", help="sim profile to predict with (default cpu-smollm2)")
    plan.add_argument("--link", help="KV link (default: the profile's)")
    plan.add_argument(
        "--engines", type=int, help="engines to split (default: the config's prefill + decode)"
    )
    plan.add_argument(
        "--wider",
        action="append",
        type=_width_profile,
        metavar="N=PROFILE",
        help="also weigh engines N cores (GPUs) wide, timed by PROFILE (repeatable)",
    )
    plan.add_argument(
        "--chunk-budget",
        action="append",
        type=int,
        metavar="TOKENS",
        help="weigh every candidate at this chunked-prefill budget (repeatable; default: the "
        "engine's own)",
    )
    plan.add_argument("--attainment", type=float, help="share meeting the SLOs (default 0.9)")
    plan.add_argument(
        "--min-gain", type=float, help="a split's goodput over colocated's to pick it (1.1)"
    )
    plan.add_argument("--ttft", type=float, help="TTFT SLO in s (default: the workload's)")
    plan.add_argument("--tpot", type=float, help="TPOT SLO in s (default: the workload's)")
    plan.add_argument(
        "--itl", type=float, help="ITL SLO in s, a request's P99 gap (default: the workload's)"
    )
    plan.add_argument(
        "--config", help="app config YAML: its `plan` section and engine shape (KV cache, ...)"
    )
    plan.add_argument("--json", action="store_true", help="the plan as JSON")
    plan.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from deploy.config import AppConfig, load_app_config
    from deploy.plan import format_plan, plan_for

    config = load_app_config(Path(args.config)) if args.config else AppConfig()
    data = config.model_dump()
    given = {
        "workload": args.workload,
        "profile": args.profile,
        "link": args.link,
        "engines": args.engines,
        "attainment": args.attainment,
        "min_gain": args.min_gain,
        "ttft_s": args.ttft,
        "tpot_s": args.tpot,
        "itl_s": args.itl,
        "wider_engines": dict(args.wider) if args.wider else None,
        "chunk_budgets": args.chunk_budget,
    }
    data["plan"] |= {k: v for k, v in given.items() if v is not None}
    config = AppConfig.model_validate(data)
    result = plan_for(config)
    if args.json:
        shown = {**asdict(result), "pick": result.best.candidate.name, "reason": result.reason()}
        print(json.dumps(shown, indent=2))
    else:
        print(format_plan(result))
    return 0


def _width_profile(text: str) -> tuple[int, str]:
    width, sep, profile = text.partition("=")
    if not sep or not width.strip().isdigit() or not profile.strip():
        raise argparse.ArgumentTypeError(
            f"expected N=PROFILE (e.g. 2=cpu-smollm2-2c-fit), got {text!r}"
        )
    return int(width), profile.strip()
