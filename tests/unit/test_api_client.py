"""The clients against an in-process gRPC server: what they send (request, `application`
metadata), how a stream is joined, and that closing a stream early cancels the call."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
import grpc.aio
import pytest

from api.client import AsyncPDServeClient, PDServeClient, acollect, collect
from api.gen.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

WORDS = ("Hello", ",", " world")


def chunks(request: pdserve_pb2.GenerateRequest, num_chunks: int) -> list[Any]:
    """`num_chunks` chunks of one token each; the last one finishes the request."""
    out = []
    for i in range(num_chunks):
        chunk = pdserve_pb2.GenerateResponse(
            request_id=request.request_id, text=WORDS[i % len(WORDS)], token_ids=[100 + i]
        )
        if i == 0:
            chunk.timings.ttft_s = 0.1
        if i == num_chunks - 1:
            chunk.finish_reason = pdserve_pb2.FINISH_REASON_LENGTH
            chunk.usage.completion_tokens = num_chunks
            chunk.timings.ttft_s, chunk.timings.e2e_s = 0.1, 0.5
        out.append(chunk)
    return out


class FakeRouter(pdserve_pb2_grpc.PDServeServiceServicer):
    """Answers from the request alone and remembers what each call carried."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []
        self.requests: list[pdserve_pb2.GenerateRequest | pdserve_pb2.CompleteRequest] = []
        self.cancelled = threading.Event()

    def _record(self, request: Any, context: Any) -> None:
        self.metadata.append(dict(context.invocation_metadata()))
        if isinstance(request, pdserve_pb2.GenerateRequest | pdserve_pb2.CompleteRequest):
            self.requests.append(request)
            if request.HasField("max_tokens") and request.max_tokens < 1:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be >= 1")

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        self._record(request, context)
        context.add_callback(self.cancelled.set)  # runs when the RPC ends, however it ends
        for chunk in chunks(request, request.max_tokens or 3):
            if not context.is_active():
                return
            yield chunk
            time.sleep(0.01)

    def Complete(self, request: Any, context: Any) -> Any:
        self._record(request, context)
        joined = collect(chunks(request, 3))
        return pdserve_pb2.CompleteResponse(text=joined.text, model=request.model or "smollm2")

    def Health(self, request: Any, context: Any) -> Any:
        self._record(request, context)
        decode = pdserve_pb2.PoolReplicas(pool=pdserve_pb2.POOL_DECODE, ready_replicas=2)
        return pdserve_pb2.HealthResponse(serving=True, pools=[decode])

    def ListModels(self, request: Any, context: Any) -> Any:
        self._record(request, context)
        return pdserve_pb2.ListModelsResponse(models=[{"id": "smollm2", "max_model_len": 8192}])


@pytest.fixture
def router() -> Iterator[tuple[FakeRouter, str]]:
    servicer = FakeRouter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pdserve_pb2_grpc.add_PDServeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_generate_streams_and_collects(router: tuple[FakeRouter, str]) -> None:
    servicer, target = router
    with PDServeClient(target, application="pdserve", timeout_s=10) as client:
        completion = collect(client.generate("Hi", max_tokens=3, seed=0, request_id="r1"))
    assert completion.text == "Hello, world"
    assert completion.token_ids == (100, 101, 102)
    assert completion.finish_reason == "length"
    assert completion.num_chunks == 3
    assert completion.usage.completion_tokens == 3
    assert (completion.timings.ttft_s, completion.timings.e2e_s) == (0.1, 0.5)
    assert completion.request_id == "r1"
    (request,) = servicer.requests
    assert request.HasField("seed") and not request.HasField("temperature")
    assert servicer.metadata[0]["application"] == "pdserve"


def test_unary_calls(router: tuple[FakeRouter, str]) -> None:
    servicer, target = router
    with PDServeClient(target) as client:
        assert client.complete("Hi").text == "Hello, world"
        (pool,) = client.health().pools
        assert (pool.pool, pool.ready_replicas) == (pdserve_pb2.POOL_DECODE, 2)
        assert [m.id for m in client.list_models().models] == ["smollm2"]
    assert [type(r).__name__ for r in servicer.requests] == ["CompleteRequest"]
    assert all("application" not in metadata for metadata in servicer.metadata)


def test_server_errors_keep_their_status(router: tuple[FakeRouter, str]) -> None:
    _, target = router
    with PDServeClient(target) as client, pytest.raises(grpc.RpcError) as error:
        client.complete("Hi", max_tokens=0)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in (error.value.details() or "")


def test_closing_a_stream_cancels_the_call(router: tuple[FakeRouter, str]) -> None:
    servicer, target = router
    with PDServeClient(target) as client:
        stream = client.generate("Hi", max_tokens=1000)
        assert next(stream).text == "Hello"
        stream.close()
        assert servicer.cancelled.wait(timeout=5)


@pytest.mark.parametrize(
    ("responses", "words"),
    [([], "after 0 chunks"), ([pdserve_pb2.GenerateResponse(text="x")], "after 1 chunks")],
)
def test_collect_refuses_a_cut_stream(responses: list[Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        collect(responses)


class AsyncFakeRouter(pdserve_pb2_grpc.PDServeServiceServicer):
    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.metadata.append(dict(context.invocation_metadata()))
        for chunk in chunks(request, request.max_tokens or 3):
            yield chunk

    async def Complete(self, request: Any, context: Any) -> Any:
        self.metadata.append(dict(context.invocation_metadata()))
        stop = pdserve_pb2.FINISH_REASON_STOP
        return pdserve_pb2.CompleteResponse(text="done", finish_reason=stop)


async def test_async_client() -> None:
    servicer = AsyncFakeRouter()
    server = grpc.aio.server()
    pdserve_pb2_grpc.add_PDServeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncPDServeClient(f"127.0.0.1:{port}", application="pdserve") as client:
            completion = await acollect(client.generate("Hi", max_tokens=2))
            assert (completion.text, completion.token_ids) == ("Hello,", (100, 101))
            assert (await client.complete(messages=[{"role": "user", "content": "x"}])).text
    finally:
        await server.stop(grace=None)
    assert [m["application"] for m in servicer.metadata] == ["pdserve", "pdserve"]
