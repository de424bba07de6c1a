"""`pdserve up --no-auth --tls-cert --tls-key`: both of Serve's proxies serve TLS only, on
loopback, and take calls without a key (every listener is on loopback, so `--no-auth` is
allowed). A client that trusts the certificate gets answers over HTTPS and gRPC (the Python
client and `pdserve generate`, which trusts the run's certificate); one that does not is refused
by its own TLS check; plaintext on either port gets no answer. The cheapest app that serves: the
tiny model's tokenizer on a colocated sim engine (cpu-smollm2: about 60 ms a token, so streams
held open outlast a burst on any machine; the tiny vLLM engine's 200 tokens a second ended them
in the proxy while a loaded client still read them, and a late call was admitted), with a
router admitting 2 calls: past them the proxies refuse calls themselves."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from api.client import PDServeClient, collect
from api.gen.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from deploy.local import free_ports
from tests.certs import self_signed
from tests.procs import descendants, listening_sockets
from tests.readme.cli import fresh_env, pdserve

pytestmark = pytest.mark.engine

# The router's admission (router.max_in_flight): the proxies' gate refuses past it.
CAPACITY = 2


@pytest.fixture(scope="module")
def tls_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, dict[str, object], dict[str, str]]]:
    home = tmp_path_factory.mktemp("home")
    env = fresh_env(home)
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    http_port, grpc_port = free_ports(2)
    config = tmp_path_factory.mktemp("config") / "app.yaml"
    config.write_text(f"router:\n  max_in_flight: {CAPACITY}\n")
    up = pdserve(
        env,
        "up",
        *("--config", str(config), "--model", "tiny", "--topology", "colocated", "--no-auth"),
        *("--engine", "sim", "--profile", "cpu-smollm2"),
        *("--tls-cert", str(cert), "--tls-key", str(key)),
        *("--http-port", str(http_port), "--grpc-port", str(grpc_port)),
        timeout=900,
    )
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert f"https://127.0.0.1:{http_port}/v1" in up.stdout
        assert "API key" not in up.stdout
        state = json.loads((home / ".cache" / "pdserve" / "run" / "local.json").read_text())
        assert state["api_key"] == ""
        yield cert, state, env
    finally:
        pdserve(env, "down", timeout=180)


def _complete(url: str, context: ssl.SSLContext | None) -> tuple[int, dict[str, object]]:
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "ignore_eos": True}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120, context=context) as response:
        return response.status, json.loads(response.read())


def test_https_with_the_certificate_answers_and_nothing_else_does(
    tls_run: tuple[Path, dict[str, object], dict[str, str]],
) -> None:
    cert, state, _ = tls_run
    port = state["http_port"]
    trusting = ssl.create_default_context(cafile=str(cert))
    status, payload = _complete(f"https://127.0.0.1:{port}", trusting)
    assert status == 200, payload
    assert payload["usage"]["completion_tokens"] == 2  # type: ignore[index]

    with pytest.raises(urllib.error.URLError) as untrusted:
        _complete(f"https://127.0.0.1:{port}", ssl.create_default_context())
    assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError), untrusted.value

    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)) as plain:
        _complete(f"http://127.0.0.1:{port}", None)
    assert not isinstance(plain.value, urllib.error.HTTPError), plain.value  # no HTTP answer


def test_grpc_with_the_certificate_answers_and_nothing_else_does(
    tls_run: tuple[Path, dict[str, object], dict[str, str]],
) -> None:
    cert, state, env = tls_run
    target = f"127.0.0.1:{state['grpc_port']}"
    with PDServeClient(target, timeout_s=120, root_certificates=cert.read_bytes()) as client:
        done = collect(client.generate("hi", max_tokens=3, ignore_eos=True))
        assert len(done.token_ids) == 3
        assert client.health().serving

    untrusted = grpc.ssl_channel_credentials()  # the system's roots only
    for channel in (grpc.insecure_channel(target), grpc.secure_channel(target, untrusted)):
        with channel:
            stub = pdserve_pb2_grpc.PDServeServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Health(pdserve_pb2.HealthRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value

    # The CLI trusts the run's own certificate.
    generated = pdserve(env, "generate", "hi", "--max-tokens", "3", "--json", timeout=180)
    assert generated.returncode == 0, generated.stdout + generated.stderr
    assert len(json.loads(generated.stdout)["token_ids"]) == 3


def test_both_proxies_listen_on_loopback_only(
    tls_run: tuple[Path, dict[str, object], dict[str, str]],
) -> None:
    _, state, _ = tls_run
    tree = descendants([int(state["ray_pid"])])  # type: ignore[call-overload]
    sockets = listening_sockets(tree)
    for name in ("http_port", "grpc_port"):
        addresses = sorted(address for address, port in sockets if port == state[name])
        assert addresses == ["127.0.0.1"], (name, sockets)


async def test_the_proxies_refuse_calls_past_capacity_before_the_router(
    tls_run: tuple[Path, dict[str, object], dict[str, str]],
) -> None:
    """CAPACITY streams held open, then gRPC and HTTP calls past them: each refused by the proxy
    (its message names the proxy, the router's names its admission) with RESOURCE_EXHAUSTED /
    429, while the held streams go on and finish whole."""
    import asyncio

    import httpx

    from api.client import AsyncPDServeClient

    cert, state, env = tls_run
    target = f"127.0.0.1:{state['grpc_port']}"
    url = f"https://127.0.0.1:{state['http_port']}/v1/completions"
    held_tokens = 300  # 18 s at the profile's pace
    async with AsyncPDServeClient(
        target, timeout_s=300, root_certificates=cert.read_bytes()
    ) as client:
        first = [asyncio.Event() for _ in range(CAPACITY)]

        async def hold(i: int) -> int:
            tokens = 0
            async for chunk in client.generate("hold", max_tokens=held_tokens, ignore_eos=True):
                first[i].set()
                tokens += len(chunk.token_ids)
            return tokens

        held = [asyncio.create_task(hold(i)) for i in range(CAPACITY)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 120)

        async def grpc_call() -> tuple[grpc.StatusCode, str]:
            try:
                async for _ in client.generate("over", max_tokens=2):
                    pass
            except grpc.aio.AioRpcError as error:
                return error.code(), error.details() or ""
            return grpc.StatusCode.OK, ""

        async with httpx.AsyncClient(verify=str(cert), timeout=60) as http:
            body = {"prompt": "over", "max_tokens": 2}
            answers = await asyncio.gather(
                *(grpc_call() for _ in range(10)), *(http.post(url, json=body) for _ in range(10))
            )
        grpc_answers, http_answers = answers[:10], answers[10:]
        assert all(not task.done() for task in held), "the held streams ended before the burst"
        for code, details in grpc_answers:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
            assert "through this proxy" in details, details
        for response in http_answers:
            assert response.status_code == 429, response.text
            error = response.json()["error"]
            assert (
                error["type"] == "rate_limit_exceeded" and "through this proxy" in error["message"]
            )
        assert await asyncio.gather(*held) == [held_tokens] * CAPACITY
        # Room again: a call now is admitted.
        done = [c async for c in client.generate("after", max_tokens=2, ignore_eos=True)]
        assert sum(len(c.token_ids) for c in done) == 2
    # Each refusal is counted, by the proxy that made it (the router never saw them).
    assert _overloaded_count(env, state, want=20) == 20


# Polls the run's metrics agents (they export every few seconds) until the overloaded count of
# pdserve_requests_total reaches argv[2] or 120 s pass; prints the last count.
_OVERLOADED = """
import sys, time
import ray
from tests.e2e.metrics import metric_sum, scrape
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + 120
while True:
    count = metric_sum(scrape(), "pdserve_requests_total", outcome="overloaded")
    if count >= float(sys.argv[2]) or time.monotonic() > deadline:
        break
    time.sleep(2)
print(count)
"""


def _overloaded_count(env: dict[str, str], state: dict[str, object], want: int) -> float:
    import subprocess
    import sys

    from deploy.local import ray_auth_env

    env = {**env, **ray_auth_env(Path(str(state["ray_token_path"])))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # tests.e2e.metrics
    done = subprocess.run(
        [sys.executable, "-c", _OVERLOADED, str(state["ray_address"]), str(want)],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.strip().splitlines()[-1])


def test_up_names_a_missing_or_non_pem_tls_file(tmp_path: Path) -> None:
    env = fresh_env(tmp_path)
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("hello")
    for args, named in (
        (("--tls-cert", str(tmp_path / "absent.pem"), "--tls-key", str(not_pem)), "--tls-cert"),
        (("--tls-cert", str(not_pem), "--tls-key", str(not_pem)), "not a PEM file"),
        (("--tls-cert", str(not_pem)), "go together"),
    ):
        refused = pdserve(env, "up", *args, timeout=120)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert named in refused.stderr, refused.stderr
        assert not (tmp_path / ".cache" / "pdserve" / "run" / "local.json").exists()
