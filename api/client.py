"""Python clients for the `pdserve.v1.PDServeService` gRPC service: `PDServeClient` (blocking) and
`AsyncPDServeClient` (grpc.aio), with the same methods and keyword arguments.

    with PDServeClient("localhost:9000", application="pdserve") as client:
        for chunk in client.generate("Hello", max_tokens=16):
            print(chunk.text, end="")
        print(collect(client.generate("Hello", max_tokens=16)).text)

Both build requests with `build_request`, so an argument means the same thing in each. Errors
from the server arrive as `grpc.RpcError` (INVALID_ARGUMENT for a bad field, with its name).
"""

from __future__ import annotations

import os
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    Generator,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypedDict, Unpack

import grpc
import grpc.aio

from api.convert import finish_reason_name, role_value
from api.gen.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

# The API key clients send when none is given (as the `openai` package reads OPENAI_API_KEY).
API_KEY_ENV = "PDSERVE_API_KEY"
# A PEM file of the root certificates to trust: the channel is TLS when it is set.
TLS_ROOTS_ENV = "PDSERVE_TLS_ROOTS"

DEFAULT_TARGET = "localhost:9000"  # Ray Serve's default gRPC port


class RequestOptions(TypedDict, total=False):
    """The keyword arguments of `generate` and `complete`; see `build_request`."""

    messages: Sequence[Mapping[str, str]] | None
    model: str
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: Sequence[str]
    ignore_eos: bool | None
    request_id: str


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
    model: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool | None = None,
    request_id: str = "",
) -> pdserve_pb2.GenerateRequest:
    """A GenerateRequest; None leaves an `optional` field unset, so the server default applies.

    `messages` are OpenAI-style {"role": ..., "content": ...} dicts. Values are not checked
    here: the server validates every field and names the bad one in INVALID_ARGUMENT. Only
    what the message cannot carry is refused (ValueError), not dropped: another key in a chat
    message, or a role that `pdserve.v1.Role` has no value for.
    """
    if isinstance(stop, str):
        stop = [stop]  # one stop string, not one per character
    return pdserve_pb2.GenerateRequest(
        model=model,
        prompt=prompt,
        messages=[_chat_message(i, m) for i, m in enumerate(messages or ())],
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        request_id=request_id,
    )


def build_complete_request(
    prompt: str | None = None, **options: Unpack[RequestOptions]
) -> pdserve_pb2.CompleteRequest:
    """`build_request` for Complete. A CompleteRequest has GenerateRequest's fields with the same
    numbers (tests/unit/test_api_stubs.py holds them equal), so its wire form is the same."""
    generate = build_request(prompt, **options)
    return pdserve_pb2.CompleteRequest.FromString(generate.SerializeToString())


@dataclass(frozen=True)
class Completion:
    """A streamed completion put back together by `collect`."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    # "stop" or "length", as HTTP says it (the last chunk's pdserve.v1.FinishReason).
    finish_reason: str
    usage: pdserve_pb2.Usage
    # The last chunk's: the only one with every field set.
    timings: pdserve_pb2.Timings
    num_chunks: int


def collect(responses: Iterable[pdserve_pb2.GenerateResponse]) -> Completion:
    """Joins a `generate` stream. Raises ValueError if the stream ended without its last chunk
    (no finish_reason): a server bug that a partial text would hide."""
    return _join(list(responses))


async def acollect(responses: AsyncIterable[pdserve_pb2.GenerateResponse]) -> Completion:
    """`collect` for `AsyncPDServeClient.generate`."""
    return _join([response async for response in responses])


class PDServeClient:
    """Blocking client over one channel; `timeout_s` bounds each call (None: no deadline).
    `api_key` (default: $PDSERVE_API_KEY) goes with every call as `authorization` metadata.
    `root_certificates` (PEM bytes; default: the file $PDSERVE_TLS_ROOTS names) makes the
    channel TLS, trusting those roots; with neither it is plaintext."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        application: str | None = None,
        timeout_s: float | None = None,
        api_key: str | None = None,
        root_certificates: bytes | None = None,
    ) -> None:
        credentials = _channel_credentials(root_certificates)
        self._channel = (
            grpc.secure_channel(target, credentials)
            if credentials
            else grpc.insecure_channel(target)
        )
        self._stub = pdserve_pb2_grpc.PDServeServiceStub(self._channel)
        self._call_options = _call_options(application, timeout_s, api_key)

    def generate(
        self, prompt: str | None = None, **options: Unpack[RequestOptions]
    ) -> Generator[pdserve_pb2.GenerateResponse, None, None]:
        """Streams the completion chunk by chunk; closing the iterator cancels the call."""
        call = self._stub.Generate(build_request(prompt, **options), **self._call_options)
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once the stream has ended

    def complete(
        self, prompt: str | None = None, **options: Unpack[RequestOptions]
    ) -> pdserve_pb2.CompleteResponse:
        request = build_complete_request(prompt, **options)
        response: pdserve_pb2.CompleteResponse = self._stub.Complete(request, **self._call_options)
        return response

    def health(self) -> pdserve_pb2.HealthResponse:
        response: pdserve_pb2.HealthResponse = self._stub.Health(
            pdserve_pb2.HealthRequest(), **self._call_options
        )
        return response

    def list_models(self) -> pdserve_pb2.ListModelsResponse:
        response: pdserve_pb2.ListModelsResponse = self._stub.ListModels(
            pdserve_pb2.ListModelsRequest(), **self._call_options
        )
        return response

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class AsyncPDServeClient:
    """asyncio client over one grpc.aio channel; create it inside the event loop that uses it."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        application: str | None = None,
        timeout_s: float | None = None,
        api_key: str | None = None,
        root_certificates: bytes | None = None,
    ) -> None:
        credentials = _channel_credentials(root_certificates)
        self._channel = (
            grpc.aio.secure_channel(target, credentials)
            if credentials
            else grpc.aio.insecure_channel(target)
        )
        self._stub = pdserve_pb2_grpc.PDServeServiceStub(self._channel)
        self._call_options = _call_options(application, timeout_s, api_key)

    async def generate(
        self, prompt: str | None = None, **options: Unpack[RequestOptions]
    ) -> AsyncGenerator[pdserve_pb2.GenerateResponse, None]:
        """Streams the completion; `aclose()` (or `contextlib.aclosing`) cancels the call."""
        call = self._stub.Generate(build_request(prompt, **options), **self._call_options)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def complete(
        self, prompt: str | None = None, **options: Unpack[RequestOptions]
    ) -> pdserve_pb2.CompleteResponse:
        request = build_complete_request(prompt, **options)
        response: pdserve_pb2.CompleteResponse = await self._stub.Complete(
            request, **self._call_options
        )
        return response

    async def health(self) -> pdserve_pb2.HealthResponse:
        response: pdserve_pb2.HealthResponse = await self._stub.Health(
            pdserve_pb2.HealthRequest(), **self._call_options
        )
        return response

    async def list_models(self) -> pdserve_pb2.ListModelsResponse:
        response: pdserve_pb2.ListModelsResponse = await self._stub.ListModels(
            pdserve_pb2.ListModelsRequest(), **self._call_options
        )
        return response

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


def _channel_credentials(root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    if root_certificates is None and os.environ.get(TLS_ROOTS_ENV):
        root_certificates = Path(os.environ[TLS_ROOTS_ENV]).read_bytes()
    if root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def _call_options(
    application: str | None, timeout_s: float | None, api_key: str | None
) -> dict[str, Any]:
    metadata: list[tuple[str, str]] = []
    if application:
        # Ray Serve's gRPC proxy picks the Serve application from this metadata key.
        metadata.append(("application", application))
    api_key = api_key or os.environ.get(API_KEY_ENV)
    if api_key:
        metadata.append(("authorization", f"Bearer {api_key}"))
    return {"metadata": tuple(metadata) or None, "timeout": timeout_s}


def _chat_message(index: int, message: Mapping[str, str]) -> pdserve_pb2.ChatMessage:
    extra = sorted(set(message) - {"role", "content"})
    if extra:
        raise ValueError(f"chat message field {extra[0]!r} is not supported: only role, content")
    role = message.get("role")
    return pdserve_pb2.ChatMessage(
        # No role: left UNSPECIFIED, for the server to refuse by name like any missing field.
        role=role_value(role, f"messages[{index}].role") if role is not None else None,
        content=message.get("content", ""),
    )


def _join(responses: list[pdserve_pb2.GenerateResponse]) -> Completion:
    if not responses or not responses[-1].finish_reason:
        raise ValueError(f"the stream ended after {len(responses)} chunks without a finish_reason")
    last = responses[-1]
    return Completion(
        request_id=last.request_id,
        text="".join(r.text for r in responses),
        token_ids=tuple(token_id for r in responses for token_id in r.token_ids),
        finish_reason=finish_reason_name(last.finish_reason),
        usage=last.usage,
        timings=last.timings,
        num_chunks=len(responses),
    )
