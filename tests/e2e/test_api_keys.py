"""API keys on the served app (router/auth.py): the nixl app takes one (`ServedApp.api_key`),
the others none. Refusals are UNAUTHENTICATED / 401 with OpenAI's body, health stays open, and
every refusal is counted by outcome."""

from __future__ import annotations

import grpc
import pytest

from api.gen import pdserve_pb2, pdserve_pb2_grpc
from router.auth import new_key
from tests.e2e.conftest import ServedApp
from tests.e2e.metrics import metric_sum, scrape, wait_metric, wait_metric_at_least

pytestmark = pytest.mark.engine


def test_calls_without_a_valid_key_are_refused_and_counted(
    serve_apps: dict[str, ServedApp],
) -> None:
    import openai

    app = serve_apps["nixl"]
    assert app.api_key
    invalid_before = metric_sum(scrape(), "pdserve_requests_total", app=app.name, outcome="invalid")
    request = pdserve_pb2.GenerateRequest(prompt="hi", max_tokens=2)
    with grpc.insecure_channel(app.grpc_target) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
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
        done = pdserve_pb2_grpc.PDServeStub(channel).Complete(
            pdserve_pb2.GenerateRequest(prompt="no key here", max_tokens=2, ignore_eos=True),
            metadata=(("application", app.name),),
            timeout=120,
        )
    assert done.usage.completion_tokens == 2
