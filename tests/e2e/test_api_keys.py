"""API keys on the served app (router/auth.py): the nixl app takes one (`ServedApp.api_key`),
the others none. Refusals are UNAUTHENTICATED / 401 with OpenAI's body, health stays open, and
every refusal is counted by outcome."""

from __future__ import annotations

import grpc
import pytest

from api.gen.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from router.auth import new_key
from tests.e2e.conftest import ServedApp
from tests.e2e.metrics import settled_metric, wait_metric, wait_metric_at_least

pytestmark = pytest.mark.engine


def test_calls_without_a_valid_key_are_refused_and_counted(
    serve_apps: dict[str, ServedApp],
) -> None:
    import openai

    app = serve_apps["nixl"]
    assert app.api_key
    invalid_before = settled_metric("pdserve_requests_total", app=app.name, outcome="invalid")
    request = pdserve_pb2.GenerateRequest(prompt="hi", max_tokens=2)
    with grpc.insecure_channel(app.grpc_target) as channel:
        stub = pdserve_pb2_grpc.PDServeServiceStub(channel)
        for auth in ((), (("authorization", f"Bearer {new_key()}"),)):
            with pytest.raises(grpc.RpcError) as refused:
                list(
                    stub.Generate(request, metadata=(("application", app.name), *auth), timeout=60)
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in refused.value.details()
        health = stub.Health(
            pdserve_pb2.HealthRequest(), metadata=(("application", app.name),), timeout=60
        )
        assert health.serving
        # With the key, a bad field is still a 400-class answer, and counted as such.
        with pytest.raises(grpc.RpcError) as invalid:
            list(
                stub.Generate(
                    pdserve_pb2.GenerateRequest(prompt="hi", max_tokens=0),
                    metadata=app.metadata,
                    timeout=60,
                )
            )
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    wrong = openai.OpenAI(base_url=app.openai_base, api_key="pds-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as denied:
        wrong.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert denied.value.status_code == 401
    assert denied.value.code == "invalid_api_key"
    right = openai.OpenAI(base_url=app.openai_base, api_key=app.api_key, max_retries=0)
    assert [m.id for m in right.models.list().data] == ["tiny"]

    # Nothing else in the session sends this app a bad key: exactly the three above.
    assert wait_metric("pdserve_requests_total", 3, app=app.name, outcome="unauthenticated") == 3
    assert (
        wait_metric_at_least(
            "pdserve_requests_total", invalid_before + 1, app=app.name, outcome="invalid"
        )
        >= invalid_before + 1
    )


def test_an_app_without_keys_takes_calls_without_one(serve_apps: dict[str, ServedApp]) -> None:
    app = serve_apps["ray"]
    assert app.api_key is None
    with grpc.insecure_channel(app.grpc_target) as channel:
        done = pdserve_pb2_grpc.PDServeServiceStub(channel).Complete(
            pdserve_pb2.CompleteRequest(prompt="no key here", max_tokens=2, ignore_eos=True),
            metadata=(("application", app.name),),
            timeout=120,
        )
    assert done.usage.completion_tokens == 2


def test_a_keys_limits_refuse_past_them_on_both_surfaces_and_others_are_served(
    serve_apps: dict[str, ServedApp],
) -> None:
    """`concurrency=1`: while one stream of the key runs, its next call is RESOURCE_EXHAUSTED /
    429 naming the key, the app's other key is served, and the key works again once its stream
    ends. `rpm=3`: the fourth call in a minute is refused."""
    import dataclasses
    import json
    import time
    import urllib.error
    import urllib.request

    app = serve_apps["nixl"]
    keys = dict(app.limited_keys)

    def post(key: str) -> tuple[int, dict[str, object]]:
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        request = urllib.request.Request(
            f"{app.openai_base}/completions",
            data=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    single = dataclasses.replace(app, api_key=keys["one-at-a-time"])
    with single.client() as client:
        # 2,000 tokens (the tiny engine's context allows no more): about 10 s in the engine, so
        # the slot is still held when the calls below arrive on a loaded machine.
        held = client.generate("hold the slot", max_tokens=2000, ignore_eos=True)
        next(held)
        with pytest.raises(grpc.RpcError) as refused:
            client.complete("second", max_tokens=2)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "API key 'one-at-a-time' is at its limit" in refused.value.details()
        status, payload = post(keys["one-at-a-time"])
        assert status == 429 and "one-at-a-time" in payload["error"]["message"], payload  # type: ignore[index]
        with app.client() as unlimited:
            assert unlimited.complete("meanwhile", max_tokens=2).usage.completion_tokens == 2
        held.close()  # cancels the stream: its slot is given back
        deadline = time.monotonic() + 60
        while True:
            try:
                assert client.complete("again", max_tokens=2).usage.completion_tokens == 2
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the cancelled stream kept its slot"
                time.sleep(0.5)

    if time.time() % 60 > 45:  # the four calls must fall in one minute (Redis's clock)
        time.sleep(61 - time.time() % 60)
    rated = keys["three-a-minute"]
    assert [post(rated)[0] for _ in range(3)] == [200, 200, 200]
    status, payload = post(rated)
    assert status == 429, payload
    assert "at most 3 requests per minute" in payload["error"]["message"]  # type: ignore[index]
