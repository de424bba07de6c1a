"""What the load generator sends to: pdserve over gRPC, pdserve (or any OpenAI server) over HTTP,
or a bare vLLM AsyncLLM in this process. Each `send` streams one request and fills its record.

Every request is greedy with `ignore_eos`, so it produces exactly `max_tokens` tokens and the
systems under comparison do the same work.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from bench.record import RequestRecord, ServerTimings, prefill_path_of
from bench.workload import BenchRequest

if TYPE_CHECKING:
    import httpx

    from api.client import AsyncPDServeClient

Clock = Callable[[], float]


class Target(Protocol):
    name: str

    async def send(self, request: BenchRequest, record: RequestRecord, clock: Clock) -> None:
        """Stream `request`, appending (clock(), tokens) per chunk; raise on failure."""

    async def close(self) -> None: ...


class GrpcTarget:
    """pdserve.v1 Generate through Ray Serve's gRPC proxy. The channel is opened on the first
    request, inside the event loop that uses it."""

    def __init__(
        self,
        name: str,
        target: str,
        application: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.name = name
        self.target = target
        self._application = application
        self._api_key = api_key
        self._client: AsyncPDServeClient | None = None
        # What the system measured of itself beside the load (role flips), for the report.
        self.facts: dict[str, Any] = {}

    async def send(self, request: BenchRequest, record: RequestRecord, clock: Clock) -> None:
        if self._client is None:
            from api.client import AsyncPDServeClient

            self._client = AsyncPDServeClient(
                self.target, self._application, timeout_s=600, api_key=self._api_key
            )
        stream = self._client.generate(
            request.prompt, max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True
        )
        try:
            async for chunk in stream:
                if chunk.token_ids:
                    record.chunks.append((clock(), len(chunk.token_ids)))
                if chunk.finish_reason:
                    t = chunk.timings
                    record.server = ServerTimings(
                        t.queue_wait_s, t.prefill_s, t.kv_transfer_s, t.ttft_s,
                        t.decode_start_s, t.e2e_s,
                        prefill_path_of(t.prefill_replica, t.decode_replica),
                    )  # fmt: skip
        finally:
            await stream.aclose()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


class HttpTarget:
    """OpenAI `/v1/completions` with `stream: true` (SSE). The chunks carry text, not token
    ids: each counts as one token, and the last takes the remainder of the usage count."""

    def __init__(
        self, name: str, base_url: str, model: str = "", api_key: str | None = None
    ) -> None:
        self.name = name
        self._base = base_url.rstrip("/")
        self._model = model  # empty: the first model `/models` lists
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient | None = None

    async def send(self, request: BenchRequest, record: RequestRecord, clock: Clock) -> None:
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=self._headers)
        if not self._model:
            listed = await self._client.get(f"{self._base}/models")
            listed.raise_for_status()
            self._model = str(listed.json()["data"][0]["id"])
        body = {
            "model": self._model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        usage: dict[str, int] | None = None
        async with self._client.stream("POST", f"{self._base}/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                choices = event.get("choices") or [{}]  # the usage chunk has none
                if choices[0].get("text"):
                    record.chunks.append((clock(), 1))
                usage = event.get("usage") or usage
        if usage is not None and record.chunks:
            extra = usage["completion_tokens"] - len(record.chunks)
            at, n = record.chunks[-1]
            record.chunks[-1] = (at, max(n + extra, 1))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class EngineTarget:
    """The bare engine: vLLM's AsyncLLM called in this process, no router, Serve or Ray. The
    floor for pdserve's overhead."""

    def __init__(self, name: str, engine: Any) -> None:
        self.name = name
        self._engine = engine

    async def send(self, request: BenchRequest, record: RequestRecord, clock: Clock) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        request_id = f"bench-{request.index}-{uuid.uuid4().hex[:8]}"
        async for output in self._engine.generate(request.prompt, params, request_id):
            num_tokens = len(output.outputs[0].token_ids)
            if num_tokens:
                record.chunks.append((clock(), num_tokens))

    async def close(self) -> None:
        self._engine = None  # the engine is its starter's to shut down


def grpc_endpoint(
    target: str | None, api_key: str | None
) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """Where a load tool sends its calls and the metadata each carries: `target`, else the
    local run's gRPC address (None when there is neither); the key of `client_api_key`."""
    from deploy.local import client_api_key, load_run

    if target is None:
        run_state = load_run()
        target = run_state.grpc_target if run_state else None
    key = client_api_key(api_key)
    return target, ((("authorization", f"Bearer {key}"),) if key else ())
