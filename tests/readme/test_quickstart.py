"""The README's main job, as a new user runs it: `pdserve up` on the embedded default (a local Ray,
a private Redis, the default model on CPU, one prefill and one decode replica), a request through
it over gRPC, `pdserve status`, Ray's own CLIs against the run (`serve status`, `ray status`),
and `pdserve down` leaving no process and no listener of ours.

It runs first (tests/conftest.py orders it), under a fresh HOME with no ~/.ray and no Ray
variables: nothing an earlier run left on this machine can stand in for a missing step. Only the
model cache is passed in explicitly (building the default model is the install step's job).
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from deploy.cli import LOCAL_CONFIG
from deploy.config import load_app_config
from deploy.local import free_ports, marked_pids, pid_is_alive, ray_temp_dir
from deploy.up import ray_num_cpus
from tests.procs import descendants, listening_sockets
from tests.readme.cli import fresh_env, pdserve

pytestmark = pytest.mark.engine

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def local_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, str], dict[str, object]]]:
    home = tmp_path_factory.mktemp("home")
    env = fresh_env(home)
    http_port, grpc_port = free_ports(2)
    up = pdserve(
        env, "up", "--http-port", str(http_port), "--grpc-port", str(grpc_port), timeout=900
    )
    state_path = home / ".cache" / "pdserve" / "run" / "local.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert f"127.0.0.1:{grpc_port}" in up.stdout
        # Secure by default: one key, printed once, kept in the (0600) run state.
        printed = [line for line in up.stdout.splitlines() if line.startswith("API key: ")]
        assert printed == [f"API key: {state['api_key']}"], up.stdout
        # Each phase as it begins, with the seconds since `up` began, in order; the replicas'
        # states while the engines start.
        phases = re.findall(r"^\[ *(\d+\.\d) s\] (.*)$", up.stdout, re.MULTILINE)
        said = [text for _, text in phases]
        assert any(t.startswith("starting Ray's head") for t in said), up.stdout
        assert any(t.startswith("app ") and "Prefill STARTING" in t for t in said), up.stdout
        assert said[-1].startswith("app RUNNING: "), up.stdout
        elapsed = [float(at) for at, _ in phases]
        assert elapsed == sorted(elapsed) and elapsed[-1] > 10, phases
        yield env, state
    finally:
        pdserve(env, "down", timeout=180)


def test_generate_over_grpc_answers(local_run: tuple[dict[str, str], dict[str, object]]) -> None:
    env, _ = local_run
    done = pdserve(env, "generate", "--chat", QUESTION)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ANSWER
    assert "finish=stop" in done.stderr
    streamed = pdserve(env, "generate", "--stream", "--chat", QUESTION)
    assert streamed.returncode == 0, streamed.stderr[-2000:]
    assert streamed.stdout.strip() == ANSWER
    as_json = pdserve(env, "generate", "--json", "--chat", QUESTION)
    assert as_json.returncode == 0, as_json.stderr[-2000:]
    answer = json.loads(as_json.stdout)
    assert answer["text"] == ANSWER and answer["finish_reason"] == "stop"
    assert len(answer["token_ids"]) == answer["usage"]["completion_tokens"] > 0
    assert answer["timings"]["ttft_s"] > 0


def test_the_run_keeps_its_own_ray_token(
    local_run: tuple[dict[str, str], dict[str, object]],
) -> None:
    env, state = local_run
    token = Path(str(state["ray_token_path"]))
    assert token.is_file() and (token.stat().st_mode & 0o777) == 0o600
    assert len(token.read_text()) == 64  # 256 bits, hex: Ray's own generator
    assert not (Path(env["HOME"]) / ".ray").exists()  # the user's ~/.ray is left alone
    state_file = Path(env["HOME"]) / ".cache" / "pdserve" / "run" / "local.json"
    assert (state_file.stat().st_mode & 0o777) == 0o600  # it holds the Redis password


def test_bad_input_is_reported(local_run: tuple[dict[str, str], dict[str, object]]) -> None:
    env, _ = local_run
    bad = pdserve(env, "generate", "hello", "--max-tokens", "0")
    assert bad.returncode == 2
    assert "INVALID_ARGUMENT" in bad.stderr and "max_tokens" in bad.stderr


def test_status_shows_pools_and_latencies(
    local_run: tuple[dict[str, str], dict[str, object]],
) -> None:
    env, state = local_run
    status = pdserve(env, "status")
    assert status.returncode == 0, status.stderr[-2000:]
    for pool in ("Prefill", "Decode", "Router"):
        line = next(line for line in status.stdout.splitlines() if line.strip().startswith(pool))
        assert "RUNNING: 1" in line
    ttft = next(line for line in status.stdout.splitlines() if line.strip().startswith("ttft"))
    assert int(ttft.split()[1]) == 3  # the three generate requests above, nothing else
    assert f"dashboard http://127.0.0.1:{state['dashboard_port']}" in status.stdout
    as_json = pdserve(env, "status", "--json")
    assert as_json.returncode == 0, as_json.stderr[-2000:]
    report = json.loads(as_json.stdout)
    assert report["status"] == "RUNNING"
    for pool in ("Prefill", "Decode", "Router"):  # the autoscaler may have added one
        assert report["deployments"][pool]["replica_states"].get("RUNNING", 0) >= 1, report
    assert report["latencies"]["ttft"]["n"] == 3
    assert 0 < report["latencies"]["ttft"]["p50_s"] <= report["latencies"]["ttft"]["p99_s"]
    assert report["endpoints"]["grpc"] == f"127.0.0.1:{state['grpc_port']}"


def test_calls_without_the_runs_key_are_refused(
    local_run: tuple[dict[str, str], dict[str, object]],
) -> None:
    """Both surfaces want the key `up` printed; health stays open. (After the status test: the
    one request served here adds a latency sample.)"""
    import urllib.error
    import urllib.request

    import grpc

    from api.gen.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

    env, state = local_run
    key = str(state["api_key"])
    wrong = pdserve(env, "generate", "hi", "--api-key", key[:-2] + "xx")
    assert wrong.returncode == 2 and "UNAUTHENTICATED" in wrong.stderr, wrong.stderr[-2000:]
    with grpc.insecure_channel(f"127.0.0.1:{state['grpc_port']}") as channel:
        stub = pdserve_pb2_grpc.PDServeServiceStub(channel)
        for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", key),)):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Complete(
                    pdserve_pb2.CompleteRequest(prompt="hi", max_tokens=2),
                    metadata=metadata,
                    timeout=60,
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListModels(pdserve_pb2.ListModelsRequest(), metadata=metadata, timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert stub.Health(pdserve_pb2.HealthRequest(), timeout=60).serving

    base = f"http://127.0.0.1:{state['http_port']}"

    def post(headers: dict[str, str]) -> tuple[int, dict[str, object]]:
        body = json.dumps({"prompt": "hi", "max_tokens": 2, "ignore_eos": True}).encode()
        request = urllib.request.Request(
            f"{base}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json", **headers},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {key}"}):
        status, payload = post(headers)
        assert status == 401, (headers, payload)
        assert payload["error"]["code"] == "invalid_api_key", payload  # type: ignore[index]
    status, payload = post({"Authorization": f"Bearer {key}"})
    assert status == 200, payload
    assert payload["usage"]["completion_tokens"] == 2  # type: ignore[index]
    with urllib.request.urlopen(f"{base}/health", timeout=60) as health:
        assert health.status == 200


def test_a_grpc_message_past_the_body_limit_is_refused_by_the_proxy(
    local_run: tuple[dict[str, str], dict[str, object]],
) -> None:
    """`up` holds gRPC messages to router.max_body_bytes (8 MiB) instead of Serve's 2 GiB: one
    byte over ends RESOURCE_EXHAUSTED before the router sees it, while a 2 MB prompt still
    reaches the router and meets its own limit (INVALID_ARGUMENT naming the prompt)."""
    import grpc

    from api.gen.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

    _, state = local_run
    metadata = (("authorization", f"Bearer {state['api_key']}"),)
    limit = 8 * 1024**2
    with grpc.insecure_channel(f"127.0.0.1:{state['grpc_port']}") as channel:
        stub = pdserve_pb2_grpc.PDServeServiceStub(channel)
        for size, code, named in (
            (limit + 1, grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
            (2_000_000, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        ):
            request = pdserve_pb2.CompleteRequest(prompt="x" * size, max_tokens=2)
            assert request.ByteSize() > size
            with pytest.raises(grpc.RpcError) as refused:
                stub.Complete(request, metadata=metadata, timeout=120)
            assert refused.value.code() == code, (size, refused.value.details())
            assert named in (refused.value.details() or ""), refused.value.details()
        done = stub.Complete(
            pdserve_pb2.CompleteRequest(prompt="hi", max_tokens=2, ignore_eos=True),
            metadata=metadata,
            timeout=120,
        )
        assert len(done.token_ids) == 2  # still serving


def test_rays_own_clis_reach_the_run(
    local_run: tuple[dict[str, str], dict[str, object]],
) -> None:
    """`eval "$(pdserve env)"` points Ray's CLIs at the run: `serve status` (Serve's REST API
    on the dashboard, the request `serve deploy` also makes) shows the app and each of its
    deployments RUNNING, `ray status` (the GCS) counts the CPUs its replicas hold, and `ray list
    actors` (the dashboard's state API) names their replicas. Without the run's token the
    dashboard refuses."""
    import yaml

    env, state = local_run
    ray_env = {**env, **_exports(env)}
    assert ray_env["RAY_DASHBOARD_ADDRESS"] == f"http://127.0.0.1:{state['dashboard_port']}"
    assert ray_env["RAY_ADDRESS"] == state["ray_address"]
    assert ray_env["RAY_AUTH_TOKEN_PATH"] == state["ray_token_path"]
    bin_dir = Path(sys.executable).parent

    def ray_cli(*argv: str, cli_env: dict[str, str] = ray_env) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(bin_dir / argv[0]), *argv[1:]],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    serve = ray_cli("serve", "status")
    assert serve.returncode == 0, serve.stderr[-3000:]
    app = yaml.safe_load(serve.stdout)["applications"][state["app"]]
    assert app["status"] == "RUNNING", serve.stdout
    for name in ("Router", "Prefill", "Decode"):  # the autoscaler may have added one
        assert app["deployments"][name]["replica_states"].get("RUNNING", 0) >= 1, serve.stdout

    ray = ray_cli("ray", "status")
    assert ray.returncode == 0, ray.stderr[-3000:]
    assert "Active:" in ray.stdout and "(no failures)" in ray.stdout, ray.stdout
    used = re.search(r"^ *([\d.]+)/([\d.]+) CPU", ray.stdout, re.MULTILINE)
    assert used is not None, ray.stdout
    config = load_app_config(LOCAL_CONFIG)  # what `up` ran: its pools' CPUs are in use
    in_use = sum(pool.num_cpus * pool.num_replicas for pool in config.pools.values())
    assert float(used.group(1)) >= in_use, ray.stdout  # more once the autoscaler adds one
    assert float(used.group(2)) == ray_num_cpus(config), ray.stdout

    actors = ray_cli("ray", "list", "actors", "--filter", "state=ALIVE", "--limit", "1000")
    assert actors.returncode == 0, actors.stderr[-3000:]
    for name in ("Router", "Prefill", "Decode"):
        assert f"ServeReplica:{state['app']}:{name}" in actors.stdout, actors.stdout

    no_token = {k: v for k, v in ray_env.items() if not k.startswith("RAY_AUTH_")}
    refused = ray_cli("serve", "status", cli_env=no_token)
    assert refused.returncode != 0 and "Authentication" in refused.stderr, refused.stderr[-2000:]


# An app that Ray itself ships (its Serve test helpers): one replica that answers its own PID.
_PID_APP = """
http_options: {{host: 127.0.0.1, port: {http_port}}}
applications:
  - name: pid
    route_prefix: /pid
    import_path: ray.serve._private.test_utils:get_pid_entrypoint
    deployments: [{{name: GetPID, ray_actor_options: {{num_cpus: 0}}}}]
"""


def test_serve_deploy_adds_an_app_beside_pdserves(
    local_run: tuple[dict[str, str], dict[str, object]], tmp_path: Path
) -> None:
    """`serve deploy` (Serve's REST API on the run's dashboard) deploys a config's app into the
    run, on the run's HTTP proxy, and an empty config removes it again: Serve leaves the app
    `up` deployed through its Python API alone."""
    import urllib.request

    import yaml

    env, state = local_run
    ray_env = {**env, **_exports(env)}
    serve_bin = str(Path(sys.executable).with_name("serve"))

    def serve(*argv: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [serve_bin, *argv], env=ray_env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    def apps() -> dict[str, dict[str, object]]:
        return dict(yaml.safe_load(serve("status").stdout)["applications"])

    config = tmp_path / "pid.yaml"
    config.write_text(_PID_APP.format(http_port=state["http_port"]))
    serve("deploy", str(config))
    for _ in range(120):
        if apps().get("pid", {}).get("status") == "RUNNING":
            break
        time.sleep(1)
    assert apps()["pid"]["status"] == "RUNNING", apps()
    with urllib.request.urlopen(f"http://127.0.0.1:{state['http_port']}/pid", timeout=60) as got:
        replica_pid = int(got.read())
    assert replica_pid in marked_pids(str(state["run_id"]))  # a process of this run
    assert apps()[str(state["app"])]["status"] == "RUNNING"

    empty = tmp_path / "empty.yaml"
    empty.write_text(f"http_options: {{host: 127.0.0.1, port: {state['http_port']}}}\n"
                     "applications: []\n")  # fmt: skip
    serve("deploy", str(empty))
    for _ in range(60):
        if "pid" not in apps():
            break
        time.sleep(1)
    assert set(apps()) == {state["app"]}
    assert apps()[str(state["app"])]["status"] == "RUNNING"


def _exports(env: dict[str, str]) -> dict[str, str]:
    """The variables `pdserve env` exports, as a shell that evaluated them would hold them."""
    exports = pdserve(env, "env")
    assert exports.returncode == 0, exports.stderr[-2000:]
    found = {}
    for line in exports.stdout.splitlines():
        name, value = line.removeprefix("export ").split("=", 1)
        found[name] = shlex.split(value)[0]
    return found


# Processes of the run that are pdserve's own (not Ray's or Serve's): they listen on loopback only.
_OWN_PROCESSES = (b"/usr/bin/redis-server", b"redis-server", b"VLLM::")


def _is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_pdserves_own_listeners_are_on_loopback(
    local_run: tuple[dict[str, str], dict[str, object]],
) -> None:
    """Redis, the engines (NIXL's side channel, vLLM's own sockets), Serve's HTTP and gRPC
    proxies (the gRPC one through api/grpc_listener.py) and Ray's dashboard (Serve's REST API,
    `serve deploy`) bind loopback. What binds every interface is Ray's alone (GCS, raylet,
    agents, the dashboard's own metrics, Serve's controller and replicas: Ray 2.60 takes no
    bind address; the run's Ray token guards them): listed here, so a new one fails."""
    _, state = local_run
    tree = descendants([int(state["ray_pid"]), int(state["redis_pid"])])  # type: ignore[call-overload]
    own, exposed = [], []
    for pid in tree:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            name = argv.split(b"\0")[0].strip()[-40:].decode(errors="replace")
            is_ray = argv.startswith(b"ray::") or any(
                mark in argv
                for mark in (b"/site-packages/ray/", b"\0ray.")  # -m ray.util...
            )
            for address, port in listening_sockets([pid]):
                if argv.startswith(_OWN_PROCESSES) or port in (
                    state["http_port"],
                    state["grpc_port"],
                    state["dashboard_port"],
                ):
                    own.append((name, address, port))
                elif not _is_loopback(address):
                    exposed.append((name, address, port, is_ray))
    ports = {int(state[name]) for name in ("http_port", "grpc_port", "dashboard_port")}  # type: ignore[call-overload]
    assert {p for _, _, p in own} >= ports, own
    assert sum(1 for name, _, _ in own if name.startswith("VLLM::")) >= 4, own  # side channels
    assert [e for e in own if not _is_loopback(e[1])] == [], own
    assert [e for e in exposed if not e[3]] == [], exposed
    grpc_listeners = [e for e in own if e[2] == state["grpc_port"]]
    assert [e[:2] for e in grpc_listeners] == [("ray::ProxyActor", "127.0.0.1")], own
    assert len(exposed) >= 10, exposed  # Ray's: the list is read, not empty by mistake


_SERVE_DETAILS = """
import json, sys
import ray
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
print(json.dumps(ray.get(controller.get_serve_instance_details.remote(), timeout=60)))
"""


def test_the_redis_password_is_in_no_rest_response_argv_or_open_file(
    local_run: tuple[dict[str, str], dict[str, object]],
) -> None:
    """The three places a password leaks to others: what Serve's REST API returns (the
    controller's instance details, which `GET /api/serve/applications/` serves as JSON), any
    process's argv (/proc/*/cmdline is world-readable), and files others may read (the run's
    folder, Ray's session folder with every log, pdserve's run state). And the request routers
    still reach Redis (they read the URL from the environment, not from a kwarg): a long prompt's
    blocks are recorded in the shared prefix index."""
    import redis

    env, state = local_run
    password = urlsplit(str(state["redis_url"])).password
    assert password and len(password) >= 32, "the private Redis has a random password"
    client = redis.Redis.from_url(str(state["redis_url"]))
    pattern = f"pdserve:{state['app']}:prefix:*"
    try:
        before = len(client.keys(pattern))
        done = pdserve(env, "generate", " ".join(["river"] * 200), "--max-tokens", "2")
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(client.keys(pattern)) >= before + 6  # 200+ tokens: 6+ full blocks of 32
    finally:
        client.close()

    ray_env = {
        **env,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(state["ray_token_path"]),
    }
    details = subprocess.run(
        [sys.executable, "-c", _SERVE_DETAILS, str(state["ray_address"])],
        env=ray_env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert details.returncode == 0, details.stderr[-3000:]
    rest = json.loads(details.stdout.strip().splitlines()[-1])
    deployments = rest["applications"][state["app"]]["deployments"]
    assert {"Router", "Prefill", "Decode"} <= set(deployments)  # the real app's details
    assert password not in details.stdout

    everything = descendants([int(state["ray_pid"]), int(state["redis_pid"])])  # type: ignore[call-overload]
    everything |= set(marked_pids(str(state["run_id"])))
    assert len(everything) > 5, everything
    for pid in everything:
        with contextlib.suppress(OSError):  # a worker that exited meanwhile
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert password.encode() not in argv, (pid, argv[:200])

    folders = [
        Path(str(state["temp_dir"])),
        ray_temp_dir(str(state["run_id"])),
        Path(env["HOME"]) / ".cache" / "pdserve" / "run",
    ]
    readable = 0
    for folder in folders:
        assert folder.is_dir(), folder
        for path in folder.rglob("*"):
            if not path.is_file() or path.is_symlink():
                continue
            if path.stat().st_mode & 0o004:  # others may read it (given the folders' modes)
                readable += 1
                assert password.encode() not in path.read_bytes(), path
    assert readable > 10, "Ray's session logs are world-readable and were searched"


def test_down_leaves_no_process_and_no_listener(
    local_run: tuple[dict[str, str], dict[str, object]],
) -> None:
    env, state = local_run
    run_id = str(state["run_id"])
    roots = [int(state["ray_pid"]), int(state["redis_pid"])]  # type: ignore[call-overload]
    # Checked independently of `down`'s own marker search: the process trees of the recorded
    # PIDs, and every port those processes listen on.
    tree = descendants(roots)
    sockets = listening_sockets(tree)
    ports = {port for _, port in sockets}
    assert len(tree) > 5, tree  # Ray's head, Redis, replicas and the vLLM engine processes
    assert {int(state["http_port"]), int(state["grpc_port"])} <= ports  # type: ignore[call-overload]
    assert marked_pids(run_id), "the run's processes should carry its marker"
    down = pdserve(env, "down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert [pid for pid in tree if pid_is_alive(pid)] == []
    # By address and port: another Ray on the machine (the multi-host tests' namespaces) may
    # listen on one of these port numbers on an address of its own.
    assert listening_sockets(None) & sockets == set()
    assert marked_pids(run_id) == []
    again = pdserve(env, "down")
    assert "nothing is running" in again.stdout
