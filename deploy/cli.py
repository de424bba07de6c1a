"""The `pdserve` command line's deploy side: run the app locally (`up`, `down`), talk to it
(`generate`, `status`), operate it (`slo`, `scale`), and prepare built-in models. The entry
point, `pdserve_cli.main`, adds bench's sub-commands (bench sits above deploy)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from deploy.cli_ops import add_operator_commands
from deploy.cli_plan import add_plan_command
from deploy.cli_sim import add_sim_commands
from engine.models import builtin_names, resolve_model

if TYPE_CHECKING:
    from api.client import Completion

LOCAL_CONFIG = Path(__file__).resolve().parent / "configs" / "local.yaml"

# Adds sub-commands to `pdserve` (bench.cli.add_bench_commands).
AddCommands = Callable[[argparse._SubParsersAction], None]


def _cmd_model_prepare(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    path = resolve_model(args.name)
    print(f"{args.name}: {path} ({time.perf_counter() - started:.1f} s)")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from deploy.config import AppConfig, load_app_config, with_sim_engine
    from deploy.up import PhaseClock, up

    data = load_app_config(Path(args.config)).model_dump()
    if args.model:
        data["engine"]["model"] = args.model
    if args.topology:
        data["topology"] = args.topology
    if args.backend:
        data["kv_transfer"]["backend"] = args.backend
    if args.engine == "sim":
        data = with_sim_engine(data, args.profile, args.sim_link, args.start_delay)
    config = AppConfig.model_validate(data)
    if config.topology == "auto":
        from deploy.plan import format_plan, resolve_auto

        print(f"pdserve up: planning the topology for workload {config.plan.workload}...")
        config, chosen = resolve_auto(config)
        assert chosen is not None
        print(format_plan(chosen), flush=True)
    if bool(args.tls_cert) != bool(args.tls_key):
        print("pdserve up: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    started = time.perf_counter()
    print(
        f"pdserve up: starting {config.name} ({config.topology}, model {config.engine.model})...",
        flush=True,
    )
    run = up(
        config,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        timeout_s=args.timeout,
        auth=not args.no_auth,
        tls=(args.tls_cert, args.tls_key) if args.tls_cert else None,
        report=PhaseClock(),
    )
    print(f"pdserve is up in {time.perf_counter() - started:.0f} s")
    if run.api_key:
        # Printed once; `generate` and `bench` read it from the run state.
        print(f"API key: {run.api_key}")
    elif config.router.api_keys_file:
        print(f"  API keys from {config.router.api_keys_file}")
    print(f"  gRPC    {run.grpc_target}  (pdserve.v1.PDServeService, grpc.health.v1.Health)")
    print(f"  HTTP    {run.http_url}  (OpenAI: /completions, /chat/completions, /models)")
    print(f"  Ray     {run.ray_address}  (dashboard {run.dashboard_url}, loopback, token auth)")
    print('  Ray\'s CLIs (serve status, serve deploy, ray status): eval "$(pdserve env)"')
    print("  Redis   127.0.0.1 (private; URL in the run state)")
    print("  stop it with `pdserve down`")
    return 0


def _cmd_keys_new(args: argparse.Namespace) -> int:
    from router.auth import key_line, new_key

    key = new_key()
    line = key_line(args.name, key)  # checks the name first
    print(f"API key: {key}")
    print(f"keys-file line (router.api_keys_file; only the hash): {line}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from deploy.up import down

    report = down()
    if report is None:
        print("pdserve down: nothing is running")
        return 0
    if report.leftovers:
        print(f"pdserve down: processes still running: {report.leftovers}", file=sys.stderr)
        return 1
    print(f"pdserve down: stopped run {report.run_id}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from deploy.status import print_status

    return print_status(args.redis_url, args.app, as_json=args.json)


def _cmd_env(args: argparse.Namespace) -> int:
    import shlex

    from deploy.local import load_run

    run = load_run()
    if run is None:
        print("pdserve env: nothing is running (start it with `pdserve up`)", file=sys.stderr)
        return 1
    for name, value in run.ray_cli_env().items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.json and args.stream:
        raise ValueError("--json prints the whole completion at the end: drop --stream")
    if args.local:
        return _generate_local(args)
    from api.client import PDServeClient, collect
    from deploy.local import client_api_key, load_run

    target, roots = args.target, None
    if target is None:
        run = load_run()
        target = run.grpc_target if run is not None else "127.0.0.1:9000"
        roots = run.tls_roots() if run is not None else None
    kwargs: dict[str, object] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        kwargs["seed"] = args.seed
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    import grpc

    api_key = client_api_key(args.api_key)
    with PDServeClient(
        target, timeout_s=args.timeout, api_key=api_key, root_certificates=roots
    ) as client:
        try:
            stream = client.generate(prompt, **kwargs)  # type: ignore[arg-type]
            if args.stream:
                chunks = []
                for chunk in stream:
                    print(chunk.text, end="", flush=True)
                    chunks.append(chunk)
                print()
                done = collect(chunks)
            else:
                done = collect(stream)
                if not args.json:
                    print(done.text)
        except grpc.RpcError as exc:
            print(f"pdserve: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(completion_json(done)))
        return 0
    t = done.timings
    print(
        f"[{done.usage.prompt_tokens} prompt tokens, {done.usage.completion_tokens} generated, "
        f"finish={done.finish_reason}, ttft {t.ttft_s * 1000:.0f} ms, "
        f"tpot {t.mean_tpot_s * 1000:.0f} ms, e2e {t.e2e_s * 1000:.0f} ms]",
        file=sys.stderr,
    )
    return 0


def completion_json(done: Completion) -> dict[str, object]:
    """`generate --json`: the joined stream, with usage and timings as the proto names them."""
    from google.protobuf.json_format import MessageToDict

    return {
        "request_id": done.request_id,
        "text": done.text,
        "token_ids": list(done.token_ids),
        "finish_reason": done.finish_reason,
        "usage": MessageToDict(done.usage, preserving_proto_field_name=True),
        "timings": MessageToDict(done.timings, preserving_proto_field_name=True),
    }


def _generate_local(args: argparse.Namespace) -> int:
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
    if args.json:
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion.token_ids)}
        print(
            json.dumps(
                {
                    "text": completion.text,
                    "token_ids": list(completion.token_ids),
                    "finish_reason": completion.finish_reason,
                    "usage": usage,
                }
            )
        )
        return 0
    print(completion.text)
    print(
        f"[{len(prompt_ids)} prompt tokens, {len(completion.token_ids)} generated, "
        f"finish={completion.finish_reason}, engine start {engine.start_seconds:.1f} s]",
        file=sys.stderr,
    )
    return 0


def build_parser(*more_commands: AddCommands) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray."
    )
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser("up", help="start a local Ray, Redis and the app; wait until healthy")
    up.add_argument("--config", default=str(LOCAL_CONFIG), help="pdserve or Serve config YAML")
    up.add_argument("--model", help="override engine.model (built-in name or HF folder)")
    up.add_argument("--topology", choices=["disaggregated", "colocated", "auto"])
    up.add_argument("--backend", choices=["nixl", "ray"], help="KV transfer backend")
    up.add_argument(
        "--engine",
        choices=["vllm", "sim"],
        default="vllm",
        help="sim: simulated engines timed by --profile (no engine process, no Ray CPU)",
    )
    up.add_argument("--profile", default="cpu-smollm2", help="--engine sim: engine/sim/profiles/")
    up.add_argument("--sim-link", help="--engine sim: KV link (default: the profile's)")
    up.add_argument(
        "--start-delay", type=float, default=0.0, help="--engine sim: seconds a replica takes"
    )
    up.add_argument("--http-port", type=int, default=8000)
    up.add_argument("--grpc-port", type=int, default=9000)
    up.add_argument("--timeout", type=float, default=900, help="seconds to wait for healthy")
    up.add_argument(
        "--no-auth",
        action="store_true",
        help="no API key (refused unless every listener is on loopback)",
    )
    up.add_argument("--tls-cert", help="PEM certificate: the HTTP and gRPC proxies serve TLS only")
    up.add_argument("--tls-key", help="PEM private key of --tls-cert")
    up.set_defaults(func=_cmd_up)

    down = commands.add_parser("down", help="stop everything `pdserve up` started")
    down.set_defaults(func=_cmd_down)

    status = commands.add_parser("status", help="pools, replicas, recent TTFT/TPOT percentiles")
    status.add_argument(
        "--redis-url", help="an app's control-plane Redis (default: the local run's)"
    )
    status.add_argument("--app", help="with --redis-url: the app's name")
    status.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    status.set_defaults(func=_cmd_status)

    env = commands.add_parser(
        "env", help="shell exports that point Ray's CLIs (serve, ray status) at the local run"
    )
    env.set_defaults(func=_cmd_env)

    gen = commands.add_parser("generate", help="generate a completion over gRPC")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument(
        "--json", action="store_true", help="print the completion as one JSON object (no --stream)"
    )
    gen.add_argument("--chat", action="store_true", help="send the prompt as one user message")
    gen.add_argument(
        "--target",
        help="gRPC host:port (default: the local run, else :9000); TLS when $PDSERVE_TLS_ROOTS "
        "names the root certificates to trust",
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--timeout", type=float, default=300, help="seconds for the whole call")
    gen.add_argument("--api-key", help="API key (default: $PDSERVE_API_KEY, else the local run's)")
    gen.add_argument(
        "--local", action="store_true", help="no server: run an in-process engine instead"
    )
    gen.add_argument(
        "--model",
        default="default",
        help=f"--local only: built-in name ({', '.join(builtin_names())}) or a local HF folder",
    )
    gen.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="--local only: engine dtype; bfloat16 is faster but flips near-tie greedy answers",
    )
    gen.set_defaults(func=_cmd_generate)

    add_operator_commands(commands)
    add_sim_commands(commands)
    add_plan_command(commands)
    for add_commands in more_commands:
        add_commands(commands)

    keys = commands.add_parser("keys", help="API keys for router.api_keys_file")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    new = keys_commands.add_parser("new", help="print a new key and its keys-file line")
    new.add_argument("name", help="who the key is for (named in the keys file)")
    new.set_defaults(func=_cmd_keys_new)

    model = commands.add_parser("model", help="prepare built-in models")
    model_commands = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    prepare = model_commands.add_parser(
        "prepare", help="build or convert a built-in model into the cache (once)"
    )
    prepare.add_argument("name", choices=builtin_names())
    prepare.set_defaults(func=_cmd_model_prepare)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:  # a checkout that was never installed
        return "unknown"


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run its command; a ValueError or RuntimeError is one line, exit 2."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
