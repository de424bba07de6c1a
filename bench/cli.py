"""`pdserve bench run`, `pdserve bench compare` and `pdserve bench report`."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from bench.runner import Arrival
from bench.targets import GrpcTarget, HttpTarget, Target
from deploy.cli_ops import duration_arg

if TYPE_CHECKING:
    from bench.report import Report
    from bench.stats import SLO
    from deploy.config import AppConfig

LOCAL_CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "local.yaml"


def add_bench_commands(commands: argparse._SubParsersAction) -> None:
    from bench.systems import ALL_SYSTEMS, DEFAULT_SIM_PROFILE, SYSTEMS
    from deploy.workload import workload_names

    bench = commands.add_parser("bench", help="latency, goodput and cost, side by side")
    actions = bench.add_subparsers(dest="bench_command", required=True, metavar="ACTION")

    run = actions.add_parser(
        "run",
        help="start each system in turn and measure it (or measure a running endpoint)",
        description="By default: the disaggregated app, the colocated app and the bare engine, "
        "one after the other on the same cores, each through every workload.",
    )
    run.add_argument(
        "--workload", action="append", metavar="NAME|YAML",
        help=f"named ({', '.join(workload_names())}) or a YAML file; repeat for several "
        "(default: chat)",
    )  # fmt: skip
    run.add_argument("--systems", nargs="+", choices=ALL_SYSTEMS, default=list(SYSTEMS))
    run.add_argument(
        "--sim-profile",
        default=DEFAULT_SIM_PROFILE,
        help="the sim system's profile when the config names none (engine/sim/profiles/)",
    )
    run.add_argument("--config", default=str(LOCAL_CONFIG), help="pdserve config the apps use")
    run.add_argument("--model", help="override engine.model (also the prompts' tokenizer)")
    endpoint = run.add_argument_group("a running endpoint instead of --systems")
    endpoint.add_argument("--target", help="gRPC host:port of a running pdserve")
    endpoint.add_argument("--app", help="Serve application name (gRPC metadata)")
    endpoint.add_argument("--http", metavar="URL", help="OpenAI base URL, e.g. http://h:8000/v1")
    endpoint.add_argument("--label", default="endpoint", help="the system's name in the report")
    endpoint.add_argument(
        "--api-key", help="the endpoint's API key (default: $PDSERVE_API_KEY, else the local run's)"
    )
    load = run.add_argument_group("load (default: each workload's own)")
    load.add_argument("--rate", type=float, action="append", help="Poisson req/s; repeat to sweep")
    load.add_argument(
        "--concurrency", type=int, action="append", help="closed loop: requests in flight"
    )
    load.add_argument("--num-requests", type=int, help="requests per load point")
    load.add_argument("--warmup", type=int, default=2, help="requests sent first, not measured")
    load.add_argument("--seed", type=int, default=0)
    report = run.add_argument_group("report")
    report.add_argument("--slo-ttft", type=duration_arg, metavar="DURATION", help="e.g. 2s")
    report.add_argument("--slo-tpot", type=duration_arg, metavar="DURATION", help="e.g. 100ms")
    report.add_argument(
        "--slo-itl", type=duration_arg, metavar="DURATION", help="a request's P99 gap, e.g. 50ms"
    )
    report.add_argument("--attainment", type=float, default=0.9, help="goodput's SLO target")
    report.add_argument("--dollars-per-hour", type=float, default=1.0, help="the machine's price")
    report.add_argument("--out", help="report folder (default bench/results/<time>)")
    report.add_argument("--no-progress", action="store_true")
    run.set_defaults(func=cmd_run)

    compare = actions.add_parser("compare", help="ratios from a report: overhead and goodput")
    compare.add_argument("report", help="report.json written by `pdserve bench run`")
    _add_judging_flags(compare)
    compare.set_defaults(func=cmd_compare)

    fid = actions.add_parser(
        "fidelity", help="a sim system's latencies against the real one's, per load point"
    )
    fid.add_argument("report", help="report.json with runs of both systems")
    fid.add_argument("--sim", default="sim", help="the simulated system's name in the report")
    fid.add_argument("--real", default="disaggregated", help="the real system's name")
    fid.set_defaults(func=cmd_fidelity)

    rerender = actions.add_parser(
        "report", help="rewrite a report's markdown and plots, optionally against another SLO"
    )
    rerender.add_argument("report", help="report.json written by `pdserve bench run`")
    _add_judging_flags(rerender)
    rerender.add_argument(
        "--out",
        help="folder for the new files (default: the report's; with --max-prompt-tokens N its "
        "subfolder prompts-up-to-N)",
    )
    rerender.set_defaults(func=cmd_report)

    from bench import relay

    relay_cmd = actions.add_parser(
        "relay",
        help="the token path: pdserve's streams beside a bare gRPC server's, CPU per token",
        description=relay.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    relay.add_arguments(relay_cmd)
    relay_cmd.set_defaults(func=relay.run)


def _add_judging_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slo-ttft", type=duration_arg, metavar="DURATION", help="judge anew")
    parser.add_argument("--slo-tpot", type=duration_arg, metavar="DURATION", help="judge anew")
    parser.add_argument("--slo-itl", type=duration_arg, metavar="DURATION", help="judge anew")
    parser.add_argument("--attainment", type=float, help="goodput's SLO target, e.g. 0.9")
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        metavar="N",
        help="judge only the requests whose prompt is at most N tokens (a mixed workload's "
        "short ones)",
    )


def cmd_run(args: argparse.Namespace) -> int:
    from bench.suite import BenchPlan, run_benchmark
    from deploy.config import AppConfig, load_app_config
    from deploy.workload import load_workload
    from engine.models import resolve_model
    from engine.prompts import load_tokenizer

    if args.rate and args.concurrency:
        raise ValueError("give --rate or --concurrency, not both")
    arrivals = [Arrival("poisson", r) for r in args.rate or ()] + [
        Arrival("closed", c) for c in args.concurrency or ()
    ]
    plan = BenchPlan(
        workloads=[load_workload(w) for w in args.workload or ["chat"]],
        arrivals=arrivals or None,
        num_requests=args.num_requests,
        slo=_slo(args),
        dollars_per_hour=args.dollars_per_hour,
        attainment_target=args.attainment,
        num_warmup=args.warmup,
        seed=args.seed,
        progress=not args.no_progress,
    )
    data = load_app_config(Path(args.config)).model_dump()
    if args.model:
        data["engine"]["model"] = args.model
    if "auto" in args.systems and not (args.target or args.http):
        # `topology: auto` plans for one workload and SLO: the one this run judges by.
        if len(plan.workloads) != 1:
            raise ValueError("--systems auto plans for one workload: give one --workload")
        data["plan"]["workload"] = (args.workload or ["chat"])[0]
        if plan.slo is not None:
            data["plan"] |= {"ttft_s": plan.slo.ttft_s, "tpot_s": plan.slo.tpot_s}
    config = AppConfig.model_validate(data)
    out = Path(args.out or f"bench/results/{time.strftime('%Y%m%d-%H%M%S')}")
    tokenizer = load_tokenizer(str(resolve_model(config.engine.model)))
    meta = {"command": " ".join(["pdserve", *sys.argv[1:]]), "model": config.engine.model}
    report, paths = run_benchmark(plan, _systems(args, config), tokenizer, out, meta)
    from bench.compare import compare, format_comparisons

    for path in paths:
        print(f"wrote {path}")
    print(format_comparisons(compare(report)))
    return 0 if all(run.summary.num_completed for run in report.runs) else 1


def _systems(
    args: argparse.Namespace, config: AppConfig
) -> list[Callable[[], AbstractContextManager[Target]]]:
    if args.target and args.http:
        raise ValueError("give --target (gRPC) or --http, not both")
    if args.target or args.http:
        from deploy.local import client_api_key

        api_key = client_api_key(args.api_key)
    if args.target:
        return [partial(_running, GrpcTarget(args.label, args.target, args.app, api_key))]
    if args.http:
        return [partial(_running, HttpTarget(args.label, args.http, api_key=api_key))]
    from bench.systems import start_system

    return [
        partial(start_system, system, config, sim_profile=args.sim_profile)
        for system in args.systems
    ]


@contextmanager
def _running(target: Target) -> Iterator[Target]:
    yield target


def _slo(args: argparse.Namespace) -> SLO | None:
    """The SLO of --slo-ttft and --slo-tpot, which come together or not at all, and
    --slo-itl with them (the SLO they give replaces the workload's whole, ITL bound included)."""
    from bench.stats import SLO

    if (args.slo_ttft is None) != (args.slo_tpot is None):
        raise ValueError("give both --slo-ttft and --slo-tpot, or neither")
    if args.slo_ttft is None:
        if args.slo_itl is not None:
            raise ValueError("--slo-itl needs --slo-ttft and --slo-tpot")
        return None
    return SLO(args.slo_ttft, args.slo_tpot, args.slo_itl)


def _judged_report(args: argparse.Namespace) -> Report:
    from bench.report import Report

    report = Report.load(Path(args.report)).judged_by(_slo(args), args.attainment)
    if args.max_prompt_tokens is not None:
        report = report.with_prompts_up_to(args.max_prompt_tokens)
    return report


def cmd_compare(args: argparse.Namespace) -> int:
    from bench.compare import compare, format_comparisons

    print(format_comparisons(compare(_judged_report(args))))
    return 0


def cmd_fidelity(args: argparse.Namespace) -> int:
    from bench.compare import fidelity, format_fidelity
    from bench.report import Report

    rows = fidelity(Report.load(Path(args.report)), args.sim, args.real)
    if not rows:
        print(f"no load point that both {args.sim} and {args.real} ran")
        return 1
    print(format_fidelity(rows, args.sim, args.real))
    return 0


def _default_out(args: argparse.Namespace) -> Path:
    """The report's own folder; a subfolder when requests are left out, so the report that
    holds them all is never written over by one that does not."""
    folder = Path(args.report).parent
    if args.max_prompt_tokens is None:
        return folder
    return folder / f"prompts-up-to-{args.max_prompt_tokens}"


def cmd_report(args: argparse.Namespace) -> int:
    from bench.suite import write_report

    out = Path(args.out) if args.out else _default_out(args)
    for path in write_report(_judged_report(args), out):
        print(f"wrote {path}")
    return 0
